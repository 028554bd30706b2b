"""The HTTP service of ``numaov serve``: OpenAI-shaped routes over the served models.

- :mod:`~numaov.runtime.service.app`: ``build_app``, the FastAPI application (models,
  health, stats, metrics, and the routes of each model kind);
- :mod:`~numaov.runtime.service.lm_requests`: completion and chat bodies checked into
  engine requests; :mod:`~numaov.runtime.service.chat_template`: messages to prompt text;
- :mod:`~numaov.runtime.service.lm_routes`: ``/v1/completions`` and
  ``/v1/chat/completions`` over the LM engine (whole answers and server-sent events);
- :mod:`~numaov.runtime.service.http_common`: options and limits, the error shape, body
  reading, the API-key and metrics gate; :mod:`~numaov.runtime.service.errors`;
- :mod:`~numaov.runtime.service.video_routes`: images and videos from a Wan pipeline export;
- :mod:`~numaov.runtime.service.metrics`: the Prometheus metrics;
- :mod:`~numaov.runtime.service.server`: the socket and uvicorn.

The models themselves live beside the runtime they use (:mod:`numaov.runtime.service.lm_service`).
"""
