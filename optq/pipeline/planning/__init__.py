"""Planning a run before it starts: predicted memory, disk and time (``optq quantize --dry-run``)."""

from optq.pipeline.planning.predict import plan
from optq.pipeline.planning.runplan import RUNTIME_BYTES, RunPlan, machine_speed

__all__ = ["RUNTIME_BYTES", "RunPlan", "machine_speed", "plan"]
