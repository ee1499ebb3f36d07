"""Step records: the one type that crosses layers (schema here; shards in a later issue)."""

from agent_r1.records.schema import STEP_SCHEMA, StepRecord, Trajectory, records_from_table, records_to_table

__all__ = ["STEP_SCHEMA", "StepRecord", "Trajectory", "records_from_table", "records_to_table"]
