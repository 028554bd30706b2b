"""The HTTP service of ``numaov serve``: OpenAI-shaped routes over the served models.

Each model kind has the same three parts: its requests (a body checked into a job), its
service (the model the server holds, and how a job runs on it) and its routes (parse ->
service -> answer, each route declared once in the routes object's ``ROUTES``).

- :mod:`~numaov.runtime.service.app`: ``build_app``, the FastAPI application, the common
  routes (models, health, metrics) and ``served_routes``, the one list of routes;
- the LM: :mod:`~numaov.runtime.service.lm_requests` (completion and chat bodies checked into
  engine requests; :mod:`~numaov.runtime.service.chat_template`: messages to prompt text;
  :mod:`~numaov.runtime.service.chat_output`: a chat answer's text to reasoning, content and
  tool calls),
  :mod:`~numaov.runtime.service.lm_service` (the engine over long-lived rank workers),
  :mod:`~numaov.runtime.service.lm_routes` (``/v1/completions``, ``/v1/chat/completions``,
  ``/stats``: whole answers and server-sent events);
- video: :mod:`~numaov.runtime.service.video_requests` (image and video bodies, the
  export's image rule, ``input_reference`` decoded once),
  :mod:`~numaov.runtime.service.video_service` (a Wan pipeline export: generations as jobs,
  one at a time in a worker process, a memory budget, the finished ones kept),
  :mod:`~numaov.runtime.service.video_routes` (``/v1/images/generations``, OpenAI's video
  jobs at ``/v1/videos``, the results' content);
- :mod:`~numaov.runtime.service.http_common`: the route declaration, options and limits, the
  error shape, body reading, the API-key and metrics gate; :mod:`~numaov.runtime.service.errors`;
- :mod:`~numaov.runtime.service.metrics`: the Prometheus metrics;
- :mod:`~numaov.runtime.service.server`: the socket, uvicorn, and a stop that is bounded.
"""
