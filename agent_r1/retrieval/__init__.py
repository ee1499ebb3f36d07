"""Retrieval for search agents: a passage corpus -> an index folder -> a retriever.

``corpus`` reads the common corpus layouts; ``index`` builds and loads the index folder (bm25s
sparse, optional dense MiniLM); ``server`` serves one index over HTTP for every rollout worker of a
run (the Search-R1 ``/retrieve`` API); ``client`` gives tools one ``Retriever`` interface over an
in-process index or a server.
"""
