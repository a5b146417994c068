"""The agent-fleet demo (``tessera-ray demo``, ``make demo``): the tier doing its job on real KV
from the tiny MLA model, with every figure counted by the run."""

from tessera_ray.demo.fleet import run_demo
from tessera_ray.demo.report import DemoReport, plot_report, render_summary
from tessera_ray.demo.workload import DemoConfig

__all__ = ["DemoConfig", "DemoReport", "run_demo", "render_summary", "plot_report"]
