"""Paper graphs: the user's own (JSON lines ``{"id", "title", "abstract", "references": [ids]}``)
or a seeded generated one with topical clusters, where a query's relevant set needs ``expand``.

Generated layout, per topic (a three-word phrase such as "sparse attention pruning"): two hub
papers that name the phrase in title and abstract (a search for it ranks them first), and six
papers that name it once in the abstract. Hub A cites three of the six, hub B the other three and
hub A; every paper also cites one or two papers of other topics. A search returns three papers, so
full recall needs the hubs expanded. Sibling topics share one word of the phrase, so a lexical
selector scores their papers low.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from pathlib import Path

from agent_r1.errors import AgentR1Error
from agent_r1.jsonfiles import iter_records
from agent_r1.retrieval.corpus import Passage

METHODS = ["sparse", "neural", "bayesian", "spectral", "federated", "contrastive", "robust", "adaptive",
           "causal", "quantum", "hierarchical", "stochastic"]  # fmt: skip
OBJECTS = ["attention", "graph", "kernel", "policy", "embedding", "tensor", "token", "sensor", "protein",
           "market", "image", "circuit"]  # fmt: skip
TASKS = ["pruning", "retrieval", "forecasting", "segmentation", "alignment", "compression", "planning",
         "parsing", "ranking", "denoising", "clustering", "routing"]  # fmt: skip
NOUNS = ["models", "networks", "systems", "estimators", "solvers", "architectures", "pipelines", "algorithms"]
FILLER = [
    "efficient",
    "scalable",
    "practical",
    "unified",
    "provable",
    "fast",
    "simple",
    "deep",
    "generalized",
    "online",
]
PAPERS_PER_TOPIC = 8


class GraphError(AgentR1Error, ValueError):
    pass


@dataclass
class Paper:
    id: str
    title: str
    abstract: str
    references: list[str] = field(default_factory=list)
    topic: str = ""


@dataclass
class PaperGraph:
    papers: dict[str, Paper]
    citations: dict[str, list[str]] = field(default_factory=dict)  # id -> papers citing it
    topics: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # phrase -> {relevant, hubs}

    def __post_init__(self) -> None:
        cited: dict[str, list[str]] = {pid: [] for pid in self.papers}
        for p in self.papers.values():
            for r in p.references:
                if r in cited:
                    cited[r].append(p.id)
        self.citations = cited

    def neighbours(self, pid: str) -> list[str]:
        """References, then citing papers, each once."""
        return list(
            dict.fromkeys([r for r in self.papers[pid].references if r in self.papers] + self.citations[pid])
        )

    def passages(self) -> list[Passage]:
        return [Passage(p.id, p.title, p.abstract) for p in self.papers.values()]


def make_graph(seed: int = 0, topics: int = 100) -> PaperGraph:
    rng = random.Random(seed)
    phrases: list[tuple[str, str, str]] = []
    used_pairs: set[tuple[str, str]] = set()
    for _ in range(200_000):
        if len(phrases) == topics:
            break
        t = (rng.choice(METHODS), rng.choice(OBJECTS), rng.choice(TASKS))
        pairs = {(t[0], t[1]), (t[1], t[2]), (t[0], t[2])}
        if pairs & used_pairs:  # siblings share at most one word
            continue
        used_pairs |= pairs
        phrases.append(t)
    else:
        raise ValueError(f"could not draw {topics} topics that share at most one word")
    papers: dict[str, Paper] = {}
    meta: dict[str, dict[str, list[str]]] = {}
    n = 0
    for words in phrases:
        phrase = " ".join(words)
        ids = [f"P{n + i:04d}" for i in range(PAPERS_PER_TOPIC)]
        n += PAPERS_PER_TOPIC
        hubs, rest = ids[:2], ids[2:]
        for i, pid in enumerate(ids):
            f1, f2 = rng.sample(FILLER, 2)
            if pid in hubs:
                title = f"{phrase.capitalize()}: {'a survey' if i == 0 else 'methods and benchmarks'}"
                abstract = f"We review {phrase}. This {f1} overview of {phrase} covers {f2} methods."
            else:
                n1, n2 = rng.sample(NOUNS, 2)
                title = f"{f1.capitalize()} {f2} {n1} and {n2}"
                abstract = f"A {f1} approach to {phrase} with {f2} guarantees."
            papers[pid] = Paper(pid, title, abstract, topic=phrase)
        papers[hubs[0]].references = rest[:3]
        papers[hubs[1]].references = [hubs[0], *rest[3:]]
        meta[phrase] = {"relevant": ids, "hubs": hubs}
    all_ids = list(papers)
    for p in papers.values():  # cross-topic noise
        p.references += [r for r in rng.sample(all_ids, 2) if papers[r].topic != p.topic][: rng.randint(1, 2)]
    g = PaperGraph(papers)
    g.topics = meta
    return g


def read_graph(path: str | Path) -> PaperGraph:
    """A user's paper graph: one ``{"id", "title", "abstract", "references"}`` per line."""
    papers: dict[str, Paper] = {}
    for where, o in iter_records(path, GraphError, "paper graph"):
        if not isinstance(o, dict):
            raise GraphError(f"{where}: a paper must be a JSON object")
        for k, typ in (("id", str), ("title", str), ("abstract", str), ("references", list)):
            if not isinstance(o.get(k, [] if k == "references" else None), typ):
                raise GraphError(f"{where}: {k!r} must be a {typ.__name__} (keys: {sorted(o)})")
        papers[o["id"]] = Paper(o["id"], o["title"], o["abstract"], [str(r) for r in o.get("references", [])])
    if not papers:
        raise GraphError(f"paper graph {path} is empty")
    return PaperGraph(papers)


@functools.lru_cache(maxsize=4)
def load_graph(path: str | None = None, seed: int = 0) -> PaperGraph:
    return read_graph(path) if path else make_graph(seed)
