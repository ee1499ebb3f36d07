"""One module per ``agent-r1`` command, each with ``add_parser(sub)``; ``COMMANDS`` is their order
in ``agent-r1 --help``. A command's heavy imports stay inside its ``run``: building the parser
imports every command module."""

COMMANDS = (
    "rollout",
    "data",
    "evaluate",
    "infer",
    "chat",
    "env",
    "view",
    "index",
    "retriever",
    "export",
    "serve",
    "train",
    "launch",
    "plan",
    "sweep",
    "role",
    "records",
)
