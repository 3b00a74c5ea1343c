"""The quality harness itself (bench/quality), with no model and no download: the task generators
are deterministic under a seed and build prompts of the exact length with the answer inside,
the scorer's exact match and bootstrap CIs are right on known inputs, and a rerun skips the
cells already in the CSV (resumability) while finishing the partial ones."""

import os
import random
import sys
import types

import numpy as np
import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench", "quality"))

import report  # noqa: E402
import run as harness  # noqa: E402
import scoring  # noqa: E402
import tasks  # noqa: E402

TEMPLATE = ("<user>", "</user><assistant>")


def encode(text):
    """A byte-level toy tokenizer: one token per byte."""
    return list(text.encode("utf-8"))


def decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("task", tasks.TASKS)
def test_generators_are_deterministic_exact_length_and_hold_the_answer(task):
    a = tasks.make_samples(task, 1024, 4, seed=7, encode=encode, template=TEMPLATE)
    b = tasks.make_samples(task, 1024, 4, seed=7, encode=encode, template=TEMPLATE)
    c = tasks.make_samples(task, 1024, 4, seed=8, encode=encode, template=TEMPLATE)
    assert [(s.ids, s.answers) for s in a] == [(s.ids, s.answers) for s in b]
    assert [s.ids for s in a] != [s.ids for s in c]
    assert len({tuple(s.ids) for s in a}) == 4  # the samples of a cell differ
    for s in a:
        assert len(s.ids) == 1024
        text = decode(s.ids).lower()
        assert text.startswith("<user>") and text.count("</user><assistant>") == 1
        for ans in s.answers:
            assert ans in text, (task, ans)
    # A sample depends on its index only, not on how many were asked for.
    one = tasks.make_sample(task, 1024, 2, seed=7, encode=encode, template=TEMPLATE)
    assert one.ids == a[2].ids


def test_task_contents():
    s = tasks.make_sample("niah_multikey", 2048, 0, 1, encode, TEMPLATE)
    text = decode(s.ids)
    assert text.count("One of the special magic numbers for") == 4
    assert f"for {s.meta['key']} is: {s.answers[0]}." in text
    mv = tasks.make_sample("niah_multivalue", 2048, 0, 1, encode, TEMPLATE)
    assert len(mv.answers) == 4 and len(set(mv.answers)) == 4
    vt = tasks.make_sample("vt", 2048, 0, 1, encode, TEMPLATE)
    chain = [a.upper() for a in vt.answers]
    vtext = decode(vt.ids)
    assert f"VAR {chain[0]} = {vt.meta['value']}." in vtext
    for prev, cur in zip(chain, chain[1:]):  # each hop after the one it copies
        assert vtext.index(f"VAR {prev} =") < vtext.index(f"VAR {cur} = VAR {prev}.")
    cwe = tasks.make_sample("cwe", 2048, 0, 1, encode, TEMPLATE)
    words = [w for w in decode(cwe.ids).split() if w.isalpha()]
    counts = {w: words.count(w) for w in set(words)}
    least_common = min(counts[w] for w in cwe.answers)
    others = [n for w, n in counts.items() if w not in cwe.answers and w.islower()]
    assert least_common >= 3 and least_common > max(others)


def test_exact_match():
    assert scoring.exact_match(" 1234567.\nmore", ["1234567"])
    assert scoring.exact_match("1234567", ["1234567"])
    assert not scoring.exact_match(" 12345678.", ["1234567"])
    assert not scoring.exact_match(" 123456.", ["1234567"])
    assert not scoring.exact_match("The number is 1234567.", ["1234567"])
    # Leading blank lines are skipped: the answer line is the first one with something on it.
    assert scoring.exact_match("\n\n 1234567.\n7654321", ["1234567"])
    assert not scoring.exact_match("\n\n 1234567.\n7654321", ["1234567", "7654321"])
    assert scoring.exact_match(" 2222222, 1111111 and 3333333.", ["1111111", "2222222",
                                                                    "3333333"])
    assert not scoring.exact_match(" 1111111, 1111111, 2222222", ["1111111", "2222222",
                                                                    "3333333"])
    assert not scoring.exact_match(" 1111111, 2222222", ["1111111", "2222222", "3333333"])
    assert scoring.exact_match(" ABCDE, FGHIJ", ["abcde", "fghij"])
    # Only the first k items count: what follows them cannot change the score, which is what
    # --stop-when-answered relies on.
    assert scoring.exact_match(" 1234567. It is the number", ["1234567"])
    assert not scoring.answered(" 123456", 1)
    assert scoring.answered(" 1234567.", 1) and scoring.answered(" 1234567\n", 1)
    assert not scoring.answered(" 1111111, 22", 2) and scoring.answered(" 1111111, 22 ", 2)


def test_an_answer_after_its_intro_line_or_as_a_list_is_read_whole():
    # "are" + ":" and the answer on the lines after it, as SmolLM2-135M writes niah_multivalue.
    listed = ":\n\n- 9619094\n- 2705971\n- 3009802\n- 8323326\n- 300"
    want = ["2705971", "9619094", "8323326", "3009802"]
    assert scoring.exact_match(listed, want)
    assert scoring.answer_line(listed) == "9619094; 2705971; 3009802; 8323326; 300"
    assert scoring.answered(listed, 4) and not scoring.answered(":\n\n- 9619094\n- 27", 2)
    assert scoring.exact_match("\n1. 1111111\n2) 2222222\n", ["1111111", "2222222"])
    assert scoring.exact_match(":\n\n1234567.", ["1234567"])
    # A repeated entry or a list cut short is wrong, as on one line; a list ends at a line that
    # is not an entry.
    assert not scoring.exact_match(":\n- cuda\n- cuda\n- list", ["cuda", "list", "house"])
    assert not scoring.exact_match("- 1111111\nThese are 2222222", ["1111111", "2222222"])
    # The numbers of an enumeration on one line stay items of that line (Gemma 3's ": 1. 2.").
    assert scoring.answer_line(": 1. 2. 3. 4.") == ": 1. 2. 3. 4."
    # Decoding stops when the answer has ended: after its line, or after its list.
    assert not scoring.answer_complete(":") and not scoring.answer_complete(":\n")
    assert not scoring.answer_complete(": 1234567.")
    assert scoring.answer_complete(": 1234567.\n") and scoring.answer_complete(":\n1234567\n")
    assert not scoring.answer_complete("- a\n- b\n") and not scoring.answer_complete("- a\n- b\n-")
    assert not scoring.answer_complete("- a\n- b\n3")
    assert scoring.answer_complete("- a\n- b\n\n") and scoring.answer_complete("- a\n- b\nThese")


def test_bootstrap_ci_on_known_inputs():
    assert scoring.bootstrap_ci([1.0] * 50) == (1.0, 1.0, 1.0)
    assert scoring.bootstrap_ci([0.0] * 50) == (0.0, 0.0, 0.0)
    # 50 % of 100: the normal approximation gives 0.5 +- 1.96 * 0.05 = [0.402, 0.598].
    m, lo, hi = scoring.bootstrap_ci([0.0, 1.0] * 50)
    assert m == 0.5 and 0.38 < lo < 0.42 and 0.58 < hi < 0.62
    # The CI narrows with the sample size and is reproducible (fixed seed).
    m2, lo2, hi2 = scoring.bootstrap_ci([0.0, 1.0] * 400)
    assert hi2 - lo2 < (hi - lo) / 1.8
    assert scoring.bootstrap_ci([0.0, 1.0] * 50) == (m, lo, hi)
    # Paired differences: a always one better on 30 of 60 prompts, equal elsewhere.
    a = [1.0] * 30 + [0.0] * 30
    d, dlo, dhi = scoring.paired_bootstrap_diff(a, [0.0] * 60)
    assert d == 0.5 and dlo > 0.3 and dhi < 0.7
    d, dlo, dhi = scoring.paired_bootstrap_diff(a, a)
    assert (d, dlo, dhi) == (0.0, 0.0, 0.0)


def test_kl_and_top1():
    ref = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    other = np.log(np.array([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]))
    kl, top1 = scoring.kl_top1(ref, other)
    assert kl[0] == pytest.approx(0.5 * np.log(2) + 0.25 * np.log(0.5))
    assert kl[1] == pytest.approx(0.0)
    assert top1.tolist() == [False, True]


class _FakeEngine(types.ModuleType):
    """Stands in for engine.py (no model): counts prefills and decodes, answers the first
    sample's number for every prompt."""

    def __init__(self):
        super().__init__("engine")
        self.prefills = 0
        self.decoded = []

    def prefill(self, model, ids):
        self.prefills += 1
        return types.SimpleNamespace(ids=ids, logits=None, length=int(ids.shape[1]))

    def make_runner(self, model, session, pre, cfg):
        self.decoded.append((cfg.name, int(pre.ids.shape[0])))
        return types.SimpleNamespace(close=lambda: None, kept_fraction=lambda n: cfg.budget)

    def greedy(self, runner, logits, max_new, is_stop):
        return [{"tokens": encode(" 42.\n"), "truncated": False}] * self.batch_rows

    Config = None


def _cfgs():
    from dataclasses import dataclass

    @dataclass
    class Cfg:
        method: str
        policy: str
        budget: float
        protocol: str = "prefill"
        params: str = ""
        error: str = ""

        @property
        def name(self):
            return self.policy

    return [Cfg("full", "full", 1.0), Cfg("sidecar", "snapkv", 0.25),
            Cfg("kvpress", "snapkv", 0.25), Cfg("sidecar", "omnikv", 0.25, error="unsupported")]


def _fake_harness(tmp_path, monkeypatch):
    """(the fake engine, the CSV's path, run(store)): run_task over 4 niah_single samples in
    batches of 2 and the configurations of _cfgs(), with the fake engine."""
    fake = _FakeEngine()
    monkeypatch.setitem(sys.modules, "engine", fake)
    tok = types.SimpleNamespace(decode=lambda ids, **kw: decode(ids))
    args = types.SimpleNamespace(batch=2, stop_when_answered=False)
    samples = tasks.make_samples("niah_single", 512, 4, 0, encode, TEMPLATE)
    cfgs = _cfgs()

    def run(store, progress=None):
        fake.batch_rows = 2
        harness.run_task(args, "toy", None, tok, None, store, cfgs, "niah_single", 512,
                         samples, lambda toks: b"\n" in bytes(toks),
                         progress or harness.Progress(0))
    return fake, str(tmp_path / "results.csv"), run


def test_every_line_says_n_of_m_and_the_time_left(tmp_path, monkeypatch, capsys):
    """The run is counted up front (configuration runs over batches of prompts; one for a cell
    that cannot run), and each line the harness prints starts with N of M and an ETA."""
    fake, path, run = _fake_harness(tmp_path, monkeypatch)
    store = scoring.ResultStore(path)
    samples = tasks.make_samples("niah_single", 512, 4, 0, encode, TEMPLATE)
    total = harness._units(store, "toy", "niah_single", 512, _cfgs(), samples, 2)
    assert total == 3 * 2 + 1  # 3 runnable configurations x 2 batches, 1 error cell
    progress = harness.Progress(total)
    run(store, progress)
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("  [")]
    assert [l.split(",")[0].strip() for l in lines] == [f"[{n}/7" for n in range(1, 8)]
    assert all(" elapsed, ETA " in l for l in lines), lines
    assert lines[-1].split("ETA ")[1].startswith("0:00]")  # nothing left
    assert harness._units(scoring.ResultStore(path), "toy", "niah_single", 512, _cfgs(),
                          samples, 2) == 0  # all done: a rerun has nothing to count
    assert harness.Progress.clock(3725) == "1:02:05" and harness.Progress.clock(65) == "1:05"


def test_a_rerun_skips_done_cells_and_finishes_partial_ones(tmp_path, monkeypatch):
    fake, path, run = _fake_harness(tmp_path, monkeypatch)
    cfgs = _cfgs()
    run(scoring.ResultStore(path))
    assert fake.prefills == 2  # 4 samples in batches of 2
    assert sorted(set(fake.decoded)) == [("full", 2), ("snapkv", 2)]
    assert len(fake.decoded) == 6  # 3 runnable configurations x 2 batches
    store = scoring.ResultStore(path)  # reread from disk
    assert len(store.rows) == 3 * 4 + 1  # one error row for the configuration that cannot run
    for cfg in cfgs:
        key = scoring.cell_key(harness.row_base("toy", "niah_single", 512, cfg))
        assert store.is_done(key, 4)
    # A rerun with the same CSV does nothing: no prefill, no decode, no new rows.
    fake.prefills, fake.decoded = 0, []
    run(store)
    assert (fake.prefills, fake.decoded) == (0, [])
    assert len(scoring.ResultStore(path).rows) == 13
    # Drop the kvpress rows of samples 2 and 3 (as if stopped in the middle): only that
    # configuration's second batch runs again.
    rows = [r for r in scoring.ResultStore(path).rows
            if not (r["method"] == "kvpress" and int(r["sample"]) >= 2)]
    os.remove(path)
    partial = scoring.ResultStore(path)
    partial.add(rows)
    fake.prefills, fake.decoded = 0, []
    run(scoring.ResultStore(path))
    assert fake.prefills == 1 and fake.decoded == [("snapkv", 2)]
    final = scoring.ResultStore(path).rows
    assert len(final) == 13
    assert sorted(int(r["sample"]) for r in final if r["method"] == "kvpress") == [0, 1, 2, 3]
    assert all(r["correct"] == "0" for r in final if r["policy"] != "omnikv")


def _rows(model, task, policy, budget, correct, method="sidecar"):
    return [dict(model=model, task=task, context=1024, protocol="prefill", method=method,
                 policy=policy, budget=budget, params="", sample=i, correct=c)
            for i, c in enumerate(correct)]


def test_the_report_reads_every_csv_of_the_folder_and_its_headline_ranks_per_budget(tmp_path):
    # Two runs kept in two files, the full cache measured in both (the same rows: deduplicated),
    # and a folder below that must not be read (rows set aside).
    scoring.ResultStore(str(tmp_path / "a.csv")).add(
        _rows("m", "niah_single", "full", 1, [1, 1, 1, 1])
        + _rows("m", "niah_single", "snapkv", 0.25, [1, 1, 0, 0])
        + _rows("m", "niah_single", "snapkv", 0.25, [1, 0, 0, 0], method="kvpress")
        + _rows("m", "cwe", "full", 1, [0, 0, 0, 0])
        + _rows("m", "vt", "full", 1, [1, 0, 0, 1]))
    scoring.ResultStore(str(tmp_path / "results.csv")).add(
        _rows("m", "niah_single", "full", 1, [1, 1, 1, 1])
        + _rows("m", "niah_single", "keydiff", 0.25, [1, 1, 1, 0])
        + _rows("m", "niah_single", "omnikv", 0.25, [0, 0, 0, 0]))
    (tmp_path / "old").mkdir()
    scoring.ResultStore(str(tmp_path / "old" / "x.csv")).add(
        _rows("m", "niah_single", "h2o", 0.25, [1, 1, 1, 1]))
    cells = report.aggregate(report.load_dir(str(tmp_path)))
    assert len(cells[("m", "niah_single", 1024, "prefill", "full", 1.0)]["correct"]) == 4
    assert ("m", "niah_single", 1024, "prefill", "h2o", 0.25) not in cells
    lines = report.headline(cells)
    row = next(line for line in lines if "niah_single" in line)
    # Best evicting sidecar configuration (OmniKV apart), best kvpress press, what ran.
    assert "| keydiff 0.75 / snapkv 0.25 | 0.00 | 2 / 1 |" in row, row
    assert any("m cwe 1024 (0.00, n=4)" in line for line in lines)  # no task the model can't do
    assert not any(line.startswith("| m | vt") for line in lines)  # nor one with no policy run
    assert any("full cache alone so far: m vt 1024 (0.50)" in line for line in lines)
    assert any("1 task cells, 0 with the same outcome (right or wrong) on every prompt, 0 "
               "worse" in line for line in lines)
    # A sample stored twice with different outcomes is an error, not a silent pick.
    scoring.ResultStore(str(tmp_path / "b.csv")).add(
        _rows("m", "niah_single", "keydiff", 0.25, [1, 1, 1, 1]))
    with pytest.raises(ValueError, match="disagree"):
        report.load_dir(str(tmp_path))
    # results.md and its tables come from every file too.
    os.remove(tmp_path / "b.csv")
    text = report.write(str(tmp_path), plots=False)
    assert "| keydiff | 25% | 0.75" in text and "| full | 100% | 1.00" in text


def test_redo_itemless_generates_again_the_rows_stored_without_an_item(tmp_path, monkeypatch):
    # Rows of the first-line scoring hold ":" as their answer; --redo-itemless drops them (and
    # only them) so that the next run generates exactly those samples again.
    fake, path, run = _fake_harness(tmp_path, monkeypatch)
    run(scoring.ResultStore(path))
    rows = scoring.ResultStore(path).rows
    for r in rows:
        if r["method"] == "sidecar" and r["sample"] == "3":
            r["answer"], r["correct"] = ":", "0"  # stored by the first-line scoring
        if r["method"] == "kvpress" and r["sample"] == "0":
            r["answer"], r["truncated"] = ":", "1"  # cut at max_new: generated in full
        if r["method"] == "full" and r["sample"] == "1":
            r["answer"] = "the number is 42"  # has items: kept
    os.remove(path)
    scoring.ResultStore(path).add(rows)
    fidelity = dict(rows[0], task="fidelity", answer="", sample="0", kl="0.1")
    scoring.ResultStore(path).add([fidelity])
    store = scoring.ResultStore(path)
    assert store.drop(scoring.itemless) == 1
    assert len(scoring.ResultStore(path).rows) == 13  # the CSV itself was rewritten
    assert not os.path.exists(path + ".tmp")
    fake.prefills, fake.decoded = 0, []
    run(scoring.ResultStore(path))
    assert fake.prefills == 1 and fake.decoded == [("snapkv", 2)]  # samples 2 and 3, once
    final = scoring.ResultStore(path).rows
    assert len(final) == 14
    redone = [r for r in final if r["method"] == "sidecar" and r["sample"] == "3"]
    assert [r["answer"] for r in redone] == ["42."]
    assert scoring.ResultStore(path).drop(scoring.itemless) == 0  # nothing else qualifies


def test_word_pool_is_large_and_deterministic():
    pool = tasks.word_pool()
    assert len(pool) > 300 and len(set(pool)) == len(pool)
    r = random.Random(0)
    assert tasks._key(r, set()) == tasks._key(random.Random(0), set())


def test_greedy_decodes_every_row_to_its_end_and_stops_at_max_new():
    """Rows end at different steps: decoding goes on until the last one ends (a finished row no
    longer grows), and a row that never ends is cut at max_new and flagged truncated."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import engine

    stop_token, vocab = 9, 10

    class Runner:
        """Row r emits token 1 until step ends[r], then the stop token."""

        def __init__(self, ends):
            self.ends, self.step = ends, 0

        def forward(self, ids):
            self.step += 1
            assert self.step < 100, "greedy does not stop"
            logits = torch.zeros(len(self.ends), 1, vocab)
            for r, end in enumerate(self.ends):
                logits[r, 0, stop_token if self.step >= end else 1] = 1.0
            return logits

    first = torch.zeros(3, vocab)
    first[0, stop_token] = 1.0  # row 0 ends at once
    first[1:, 1] = 1.0
    out = engine.greedy(Runner([0, 4, 1000]), first, 12, lambda r, toks: toks[-1] == stop_token)
    assert [len(o["tokens"]) for o in out] == [1, 5, 12]
    assert [o["truncated"] for o in out] == [False, False, True]
    assert out[1]["tokens"] == [1, 1, 1, 1, stop_token]


def test_omnikv_rows_run_through_select(server):
    """The harness's OmniKV rows run (they used to be error rows): on a tiny random Llama and a
    real sidecar, selecting every prompt token decodes what the full cache does, and a quarter
    selects that many tokens per filter layer at each step while every token stays held."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import engine
    import kvsidecar as kvs
    from kvsidecar.hf import blocks_for, layout_for

    cfgs = [c for c in engine.sidecar_configs([0.25, 1.0], ["prefill", "decode"])
            if c.policy == "omnikv"]
    assert [(c.protocol, c.budget, c.error) for c in cfgs] == [("decode", 0.25, ""),
                                                               ("decode", 1.0, "")]
    assert engine.omnikv_filter_layers(30) == [2, 8, 17]  # SmolLM2
    assert engine.omnikv_filter_layers(32) == []          # the sidecar's paper default
    assert engine.omnikv_filter_layers(6) == [0, 2, 3]    # layer 5 is sparse (filter 3)
    gemma = [512] * 18
    gemma[5] = gemma[11] = gemma[17] = 0
    assert engine.omnikv_filter_layers(18, gemma) == [5]  # Gemma 3 270M: 11 and 17 sparse
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2)).eval()
    model.set_attn_implementation("sdpa")
    prompt, new = 48, 8
    ids = torch.randint(1, 96, (2, prompt), generator=torch.Generator().manual_seed(1))
    pre = engine.prefill(model, ids)
    never = lambda row, toks: False  # noqa: E731
    full = engine.make_runner(model, None, pre, engine.Config("full", "full", 1.0, "prefill"))
    ref = engine.greedy(full, pre.logits, new, never)
    outs = {}
    with kvs.Client(server.address, timeout=60) as client, \
            client.attach(layout_for(model), num_blocks=2 * blocks_for(model, 64, 2)) as s:
        for cfg in cfgs:
            runner = engine.make_runner(model, s, pre, cfg)
            try:
                outs[cfg.budget] = engine.greedy(runner, pre.logits, new, never)
                kept = runner.kept_fraction(prompt)
                selection = runner.cache.last_selection
            finally:
                runner.close()
            assert kept == (prompt + new - 1) / prompt  # nothing evicted
            assert sorted(selection) == [0, 2, 3]
            k = int(np.ceil(cfg.budget * prompt))
            for item in selection[3]:
                assert len(item.filters[0].positions) == k
                assert [v.layer for v in item.sparse_layers] == [5]
                assert item.host_bytes > 0  # the sparse layer's prompt went to the host tier
    assert [o["tokens"] for o in outs[1.0]] == [o["tokens"] for o in ref]


def test_kvpress_presses_selects_presses_and_names_an_unknown_one(monkeypatch):
    """--kvpress-presses keeps only the named kvpress rows (a resumed run can leave out a slow
    press) and refuses a name that is no press, naming it."""
    from collections import namedtuple
    Config = namedtuple("Config", "method policy budget protocol params make",
                        defaults=("prefill", "", None))
    fake = types.ModuleType("engine")
    fake.Config = Config
    fake.sidecar_configs = lambda budgets, protos: [Config("sidecar", "snapkv", b)
                                                    for b in budgets]
    fake.kvpress_configs = lambda budgets, defaults: [
        Config("kvpress", name, b) for b in budgets
        for name in ("snapkv", "tova", "observed_attention")]
    monkeypatch.setitem(sys.modules, "engine", fake)
    args = types.SimpleNamespace(budgets="0.1,0.5", protocols="prefill", policies="",
                                 no_kvpress=False, kvpress_defaults=False,
                                 kvpress_presses="snapkv,tova")
    kept = [(c.method, c.policy, c.budget) for c in harness.configs(args)]
    assert ("kvpress", "observed_attention", 0.1) not in kept
    assert [k for k in kept if k[0] == "kvpress"] == [
        ("kvpress", "snapkv", 0.1), ("kvpress", "tova", 0.1),
        ("kvpress", "snapkv", 0.5), ("kvpress", "tova", 0.5)]
    args.kvpress_presses = ""
    assert sum(c.method == "kvpress" for c in harness.configs(args)) == 6
    args.kvpress_presses = "snapkv,no_such"
    with pytest.raises(SystemExit, match="no such press: no_such"):
        harness.configs(args)


def test_a_gemma_tokenizer_built_as_unigram_is_refused():
    """transformers 5.17 and earlier build Gemma's GGUF tokenizer as a Unigram model over scores
    that are not unigram log-probabilities, which cuts words into fragments the model never saw
    (the harness's Gemma 3 rows of 2026-11 were measured so). The harness refuses such a tokenizer,
    naming the fixed version, and takes a Gemma BPE tokenizer or another family's Unigram one."""
    from tokenizers import Tokenizer, models, normalizers
    from transformers import GemmaTokenizer, PreTrainedTokenizerFast
    vocab = [("<pad>", 0.0), ("<eos>", 0.0), ("<bos>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0),
             ("s", -2.0), ("\u2581s", -3.0), ("\u2581sp", -4.0)]

    def unigram():
        tk = Tokenizer(models.Unigram(vocab, unk_id=3))
        tk.normalizer = normalizers.Replace(" ", "\u2581")
        return tk
    with pytest.raises(SystemExit, match=r"Unigram.*5\.18"):
        harness.check_tokenizer(GemmaTokenizer(tokenizer_object=unigram()))
    bpe = Tokenizer(models.BPE({"<unk>": 0, "\u2581": 1, "s": 2, "p": 3, "\u2581s": 4,
                                "\u2581sp": 5}, [("\u2581", "s"), ("\u2581s", "p")],
                               unk_token="<unk>"))
    harness.check_tokenizer(GemmaTokenizer(tokenizer_object=bpe))
    harness.check_tokenizer(PreTrainedTokenizerFast(tokenizer_object=unigram()))


def test_a_kvpress_press_on_a_model_with_sliding_layers_compresses_the_global_layers_alone():
    """kvpress's rule for Gemma 3: its press compresses the full-attention layers and each
    sliding layer keeps its window. On a tiny random Gemma 3 (window 16; layers sliding,
    sliding, full) a press keeping the last half of the prompt leaves the sliding layers their
    last 15 tokens and the global layer 24 of 48, and decoding from that cache gives the logits
    of the full cache with the global layer masked to those 24 tokens (an explicit mask per
    layer type, built here independently of the harness)."""
    import torch
    from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

    import engine

    window, prompt, steps = 16, 48, 4
    types_ = ["sliding_attention", "sliding_attention", "full_attention"]
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=window, layer_types=types_, max_position_embeddings=256,
        initializer_range=0.2)).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(1, 96, (2, prompt), generator=torch.Generator().manual_seed(1))
    pre = engine.prefill(model, ids)

    class LastHalf:
        def compress(self, module, hidden, keys, values, attentions, kwargs):
            return keys[:, :, prompt // 2:], values[:, :, prompt // 2:]

    cache = engine.kvpress_cache(model, pre, LastHalf())
    assert [lay.keys.shape[2] for lay in cache.layers] == [window - 1, window - 1, prompt // 2]
    for layer in (0, 1):
        torch.testing.assert_close(cache.layers[layer].keys,
                                   pre.cache.layers[layer].keys[:, :, -(window - 1):])
    runner = engine.DynamicRunner(model, cache, prompt, 2)

    full = DynamicCache()
    for layer in range(3):
        full.update(*engine._layer_kv(pre.cache, layer), layer)
    tokens = torch.randint(1, 96, (2, steps), generator=torch.Generator().manual_seed(2))
    for step in range(steps):
        got = runner.forward(tokens[:, step:step + 1])
        position = prompt + step
        index = torch.arange(position + 1)
        masks = {"full_attention": (index >= prompt // 2),
                 "sliding_attention": (index > position - window)}
        masks = {k: m[None, None, None].expand(2, 1, 1, -1) for k, m in masks.items()}
        with torch.no_grad():
            want = model(input_ids=tokens[:, step:step + 1],
                         position_ids=torch.full((2, 1), position), attention_mask=masks,
                         use_cache=True, **{engine._cache_kwarg(model): full}).logits.float()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert runner.kept_fraction(prompt) == ((window - 1) * 2 + prompt // 2 + steps) / 3 / prompt


def test_cake_splits_the_global_layers_budget_by_the_preferences_computed_here(server):
    """inspect_layers.py's CAKE check on a tiny random Gemma 3 (window 16; layers sliding, full,
    sliding, full) and a real sidecar: the budgets the sidecar's CAKE gives the two global layers
    are the one-shot split of (C - W) x 2 by the preferences computed from the recorded prefill
    (cake.md step 2, rounded by largest remainder), the layers hold them, and with the uniform
    allocator both hold C. `needle_tokens` finds the prompt positions of an answer's text."""
    import math

    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    import engine
    import inspect_layers
    import kvsidecar as kvs
    from kvsidecar.hf import blocks_for, layout_for

    prompt, budget = 96, 0.5
    types_ = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=16, layer_types=types_, max_position_embeddings=256,
        initializer_range=0.2)).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(1, 96, (1, prompt), generator=torch.Generator().manual_seed(1))
    pre = engine.prefill(model, ids)
    glob = [1, 3]
    c = math.ceil(budget * prompt)
    prefs, split = inspect_layers.cake_preferences(pre, glob, c)
    assert all(p[2] > 0 for p in prefs) and abs(sum(split) - c * len(glob)) < 1e-6
    # Largest remainder, as cake.md step 4 rounds the final budgets.
    want = [math.floor(x) for x in split]
    for i in sorted(range(len(split)), key=lambda i: -(split[i] - want[i]))[:c * 2 - sum(want)]:
        want[i] += 1
    assert want[0] != want[1]  # the preferences differ: a uniform split would not pass

    args = inspect_layers.parse_args(["--policies", "cake", "--uniform", "cake", "--budgets",
                                      str(budget)])
    cfgs = inspect_layers.configs(args)
    assert [cf.policy for cf in cfgs] == ["cake", "cake+uniform"]
    got = {}
    with kvs.Client(server.address, timeout=60) as client, \
            client.attach(layout_for(model), num_blocks=2 * blocks_for(model, 128, 1)) as s:
        for cf in cfgs:
            runner = engine.make_runner(model, s, pre, cf)
            try:
                got[cf.policy] = inspect_layers.held(s, runner.cache.sequence_ids[0], glob,
                                                     [prompt - 1])
            finally:
                runner.close()
    assert [got["cake"][layer][:2] for layer in glob] == [(n, n) for n in want]
    assert [got["cake+uniform"][layer][0] for layer in glob] == [c, c]
    # The last prompt token is in CAKE's window: every global layer holds it.
    assert all(v[2] == 1 for held in got.values() for v in held.values())

    class Tok:
        def decode(self, toks):
            return "".join(chr(t) for t in toks)
    text = "ab 12345 cd"
    assert inspect_layers.needle_tokens(Tok(), [ord(ch) for ch in text], ["345"]) == [5, 6, 7]
