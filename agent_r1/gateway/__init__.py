"""Train any agent program: an OpenAI-compatible gateway that records every chat completion an
agent program makes as one step of its episode.

- ``session``: one episode's conversation, token in / token out (``Session.complete``);
- ``server``: the gateway, one per worker process: ``/sessions/<id>/v1/chat/completions`` in
  front of the run's policy servers, and ``/sessions/<id>/reward``;
- ``programs``: how an agent program starts (a command, or a Python callable forked from a
  pre-imported process) and is stopped with everything it started;
- ``flow``: ``ExternalAgentFlow``, the agent flow that runs one program per episode.
"""
