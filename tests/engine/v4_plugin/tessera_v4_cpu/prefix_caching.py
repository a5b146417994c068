"""Keeping prefix caching on for MLA-style models (DeepSeek-V4 among them) on a CPU without AMX.

vLLM 0.32.0's CPU platform turns prefix caching and chunked prefill off in
``CpuPlatform.check_and_update_config`` when the model uses MLA and the AMX kernels are not in
use (``vllm/platforms/cpu.py``, the ``amx_mla_or_dsv4_enabled`` branch). A reference engine
that compares a prefix hit with a cold run needs it back: this wraps that method so that the
``enable_prefix_caching`` value it found is restored after it ran. Chunked prefill stays off.
The engine's configuration is settled in the front-end process, where vLLM loads this plugin
before building it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["keep_configured_prefix_caching"]

_MARK = "_tessera_keeps_prefix_caching"


def keep_configured_prefix_caching() -> None:
    """Wrap ``CpuPlatform.check_and_update_config`` (once per process)."""
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    if getattr(platform.check_and_update_config, _MARK, False):
        return
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        configured = vllm_config.cache_config.enable_prefix_caching
        original(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = configured

    setattr(check_and_update_config, _MARK, True)
    platform.check_and_update_config = classmethod(check_and_update_config)
