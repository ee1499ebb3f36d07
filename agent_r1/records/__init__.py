"""Step records: the one type that crosses layers (``schema``), their Arrow shards on the shared
filesystem (``shard``: written atomically with a manifest; ``reader``: checked and read back)."""

from agent_r1.records.schema import STEP_SCHEMA, StepRecord, Trajectory, records_from_table, records_to_table

__all__ = ["STEP_SCHEMA", "StepRecord", "Trajectory", "records_from_table", "records_to_table"]
