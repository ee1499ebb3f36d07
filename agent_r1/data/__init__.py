from agent_r1.data.rows import DataRow, RowError, load_rows, rows_to_table, validate_row, write_rows

__all__ = ["DataRow", "RowError", "load_rows", "rows_to_table", "validate_row", "write_rows"]
