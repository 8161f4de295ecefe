"""The traffic and burst metrics of a run (see docs/how-to/telemetry.md): ``analyze(run_dir)``."""
from controller.results.analysis.report import AnalysisConfig, analyze

__all__ = ["AnalysisConfig", "analyze"]
