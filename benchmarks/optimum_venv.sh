#!/usr/bin/env bash
# The optimum-intel venv that benchmarks/lm_engine.py runs its side-by-side anchor in.
# optimum-intel is a benchmark dependency only: it never goes into numaov's own venv.
# torch is pinned to the CPU build numaov uses (any other torch request pulls a CUDA build);
# openvino is pinned to the one numaov runs, so both systems use the same runtime.
# optimum-intel 2.2 caps deepseek_v2 exports at transformers 4.53.3, which has no DeepseekV2 of
# its own (it needs DeepSeek's remote modeling code, which is not downloaded here): the pip
# resolver's transformers 5 stays, and benchmarks/lm_engine.py lifts the cap in its process.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${OPTIMUM_VENV:-$here/.optimum-venv}"
python="${PYTHON:-python3.11}"
numaov_openvino="$("$here/../.venv/bin/python" -c 'import openvino, importlib.metadata as m; print(m.version("openvino"))')"
"$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install "torch==2.13.0" "openvino==$numaov_openvino" "optimum-intel[openvino]" "$@"
# optimum-intel pulls torchvision, whose wheel here is built for another torch ("operator
# torchvision::nms does not exist" on import, which breaks transformers' AutoProcessor and so
# optimum.intel.openvino); nothing here needs it.
"$venv/bin/pip" uninstall --yes torchvision
"$venv/bin/python" -c 'import optimum.intel, transformers, torch, openvino; print("optimum-intel venv:", optimum.intel.__version__ if hasattr(optimum.intel, "__version__") else "", "transformers", transformers.__version__, "torch", torch.__version__, "openvino", openvino.__version__)'
