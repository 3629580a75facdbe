"""Requests like users' (m2r2_tools.user_requests): every kind in its share, follow-up turns, and nothing that shares
a run of words with an evaluation question; the committed set (the third GPU run's prompts) keeps to that too."""

import gzip
import json
import random
from pathlib import Path
from types import SimpleNamespace

from m2r2_tools.user_requests import KINDS, Banned, build, kinds_table

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "data" / "smollm2-gpu3" / "prompts.jsonl.gz"
EVALUATION = [ROOT / "bench" / "data" / "question.jsonl", ROOT / "bench" / "data" / "heldout.jsonl"]


def _corpora() -> SimpleNamespace:
    rng = random.Random(0)
    words = "the whale sea ship captain morning letter sister ball house garden money nation law war peace".split()

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n)) + "."

    stub = 'def add(a, b):\n    """Return a + b."""\n'
    return SimpleNamespace(
        sotu_passages=[(f"President {i}", text(60)) for i in range(40)],
        moby_dick_passages=[text(60) for _ in range(40)],
        austen_passages=[("Emma", text(80)) for _ in range(40)],
        shakespeare_passages=[("Hamlet", text(50)) for _ in range(40)],
        python_prose=[text(50) for _ in range(40)],
        humaneval_prompts=[stub.replace("add", f"add{i}") for i in range(40)],
        python_functions=[(f"f{i}(x)", "Return x.") for i in range(40)],
        python_glossary=[(f"term{i}", "A thing.") for i in range(40)],
    )


def test_every_kind_gets_its_share_and_some_follow_ups():
    conversations, _ = build(_corpora(), 300, seed=1, follow_up=0.3)
    assert len(conversations) == 300
    count = {k: sum(c["category"] == k for c in conversations) for k in KINDS}
    for kind, (_, share) in KINDS.items():
        assert abs(count[kind] - 300 * share) <= 2, kind
    multi = sum(len(c["turns"]) == 2 for c in conversations)
    assert 60 <= multi <= 120
    assert len({c["turns"][0] for c in conversations}) == 300
    assert "| all | 300 |" in kinds_table(conversations)


def test_a_request_sharing_a_run_of_words_with_an_evaluation_question_is_dropped(tmp_path):
    corpora = _corpora()
    evaluation = tmp_path / "q.jsonl"
    pasted = corpora.moby_dick_passages[0]
    evaluation.write_text(json.dumps({"turns": [f"Summarize: {pasted}"]}) + "\n")
    banned = Banned([evaluation], overlap=8)
    assert banned.reason(f"Can you give me the gist of this?\n\n{pasted}") == "evaluation overlap"
    assert banned.reason("What is 12 * 31?") is None
    conversations, dropped = build(corpora, 200, seed=2, banned=banned)
    assert all(pasted not in t for c in conversations for t in c["turns"])


def test_the_committed_set_shares_no_run_of_eight_words_with_spec_bench_or_the_heldout_set():
    conversations = [json.loads(line) for line in gzip.decompress(COMMITTED.read_bytes()).decode().splitlines()]
    assert len(conversations) >= 4000
    assert {c["category"] for c in conversations} == set(KINDS)
    banned = Banned(EVALUATION, overlap=8)
    assert not [c for c in conversations if any(banned.reason(t) for t in c["turns"])]
