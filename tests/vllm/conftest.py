"""The vLLM connector tests run only where vLLM is installed (``make test-vllm``, its own
virtualenv). Without vLLM they are not collected at all, so the main suite neither imports nor
reports them."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") is not None else ["test_*.py", "_*.py"]
