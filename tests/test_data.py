"""Embedded corpus, local files, tokenizer, packing, sharding and exact iterator resume."""
import json

import numpy as np
import pytest

from elastic_jax.training import data


@pytest.fixture(scope="module")
def docs():
  return data.default_corpus(n_text=300, n_reasoning=60, seed=0)


@pytest.fixture(scope="module")
def tok(docs):
  return data.train_tokenizer(docs, 512)


def test_default_corpus(docs):
  assert len(docs) == 360
  traces = [d for d in docs if data.THINK in d]
  assert len(traces) == 60 and all(data.END_THINK in d for d in traces)
  assert any("God" in d for d in docs)
  ex = data.reasoning_examples(2, seed=3, sources=("gsm_symbolic",))[0]
  assert ex["think"] and ex["answer"] and data.format_example(ex, with_answer=False).endswith(
      data.END_THINK)
  with pytest.raises(ValueError, match="unknown reasoning sources"):
    data.reasoning_examples(2, sources=("chess",))
  mix = data.reasoning_examples(10, seed=1, weights=(0.7, 0.15, 0.15))
  assert [sum(e["source"] == s for e in mix) for s in data.REASONING_SOURCES] == [8, 1, 1]
  with pytest.raises(ValueError, match="one non-negative weight per source"):
    data.reasoning_examples(4, weights=(1.0,))


def test_default_corpus_leaves_out_the_held_out_questions():
  held = data.reasoning_examples(64, seed=9, sources=("chain_arithmetic",))
  kw = dict(n_text=0, n_reasoning=3000, seed=0, sources=("chain_arithmetic",))
  every, kept = data.default_corpus(**kw), data.default_corpus(
      **kw, exclude_questions=[e["question"] for e in held])
  question = lambda d: d.split("\n")[0]
  overlap = {question(d) for d in every} & {e["question"] for e in held}
  assert overlap and len(kept) == len(every) - sum(question(d) in overlap for d in every)
  assert not {question(d) for d in kept} & {e["question"] for e in held}


def test_main_job_corpus_leaves_out_its_held_out_questions(tmp_path, monkeypatch):
  from configs import tiny
  from elastic_jax.training import pipeline
  seen = {}
  real = data.default_corpus
  monkeypatch.setattr(data, "default_corpus", lambda *a, **kw: seen.update(kw) or real(*a, **kw))
  c = tiny.get_config()
  c.data.update(n_text=300, n_reasoning=300, batch=4)
  c.eval.n_reasoning = 8
  run = pipeline.Run(c, str(tmp_path))
  pipeline.load_data(run, tiny.MODEL)
  held = [e["question"] for e in pipeline.held_out(run)]
  assert len(held) == 8 and list(seen["exclude_questions"]) == held


def test_chain_arithmetic_traces():
  assert data.chain_trace("3 + 4 - 9") == "3 + 4 = 7 ; 7 - 9 = -2"
  for ex in data.reasoning_examples(20, seed=2, sources=("chain_arithmetic",)):
    last = ex["think"].split(" = ")[-1]
    assert last == ex["answer"] and eval(ex["question"][len("Calculate "):-1]) == int(last)
  with pytest.raises(ValueError, match="expected 'a op b"):
    data.chain_trace("3 * 4")


def test_tokenizer(tok, tmp_path):
  assert [tok.token_to_id(t) for t in data.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
  enc = tok.encode("12+34 <think> go </think>7")
  assert enc.tokens[:5] == ["1", "2", "+", "3", "4"] and "<think>" in enc.tokens
  assert tok.decode(enc.ids, skip_special_tokens=False).replace(" ", "") == "12+34<think>go</think>7"
  path = str(tmp_path / "tok.json")
  tok.save(path)
  assert data.load_tokenizer(path).encode("abc").ids == tok.encode("abc").ids
  with pytest.raises(ValueError, match="does not exist"):
    data.load_tokenizer(str(tmp_path / "missing.json"))


def test_pack():
  rows = data.pack([[5, 6], [7, 8, 9]], seq_len=3)
  np.testing.assert_array_equal(rows, [[1, 5, 6, 2], [1, 7, 8, 9]])
  with pytest.raises(ValueError, match="shorter than one row"):
    data.pack([[5]], seq_len=10)


def test_sharding_and_exact_resume():
  rows = np.arange(40 * 5, dtype=np.int32).reshape(40, 5)
  shards = [np.concatenate(list(_take(iter(data.make_dataset(rows, 4, shard_index=i,
                                                            shard_count=2, num_epochs=1)), 5)))
            for i in range(2)]
  firsts = [set(s[:, 0]) for s in shards]
  assert not firsts[0] & firsts[1] and len(firsts[0] | firsts[1]) == 40
  ds = data.make_dataset(rows, 4, seed=7, shard_index=0, shard_count=1)
  it = iter(ds)
  _ = list(_take(it, 13))  # past an epoch boundary
  state = json.loads(json.dumps(it.get_state()))  # JSON-able, saved with the model
  expected = list(_take(it, 5))
  resumed = iter(ds)
  resumed.set_state(state)
  for a, b in zip(expected, _take(resumed, 5)):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="fewer than batch_size"):
    data.make_dataset(rows[:3], 4, shard_index=0, shard_count=1)


def test_local_files(tmp_path):
  (tmp_path / "a.txt").write_text("first doc\n\nsecond doc\n")
  (tmp_path / "b.jsonl").write_text(json.dumps({"text": "third"}) + "\n")
  assert data.local_corpus([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]) == [
      "first doc", "second doc", "third"]
  (tmp_path / "c.jsonl").write_text('{"body": 1}\n')
  with pytest.raises(ValueError, match="c.jsonl:1: expected a JSON object with a 'text'"):
    data.local_corpus([str(tmp_path / "c.jsonl")])
  with pytest.raises(ValueError, match="expected .txt or .jsonl"):
    (tmp_path / "d.csv").write_text("x")
    data.local_corpus([str(tmp_path / "d.csv")])
  with pytest.raises(ValueError, match="does not exist"):
    data.local_corpus([str(tmp_path / "nope.txt")])
  # Errors name the file (and line): UTF-16, binary, a null or non-string "text".
  (tmp_path / "u16.txt").write_text("hello\nworld\n", encoding="utf-16")
  with pytest.raises(ValueError, match="u16.txt.*not UTF-8 text near line 1"):
    data.local_corpus([str(tmp_path / "u16.txt")])
  (tmp_path / "bin.txt").write_bytes(b"ok line\nab\x00\x00cd\n")
  with pytest.raises(ValueError, match="bin.txt:2: NUL bytes"):
    data.local_corpus([str(tmp_path / "bin.txt")])
  (tmp_path / "null.jsonl").write_text('{"text": "fine"}\n{"text": null}\n')
  with pytest.raises(ValueError, match="null.jsonl:2: 'text' must be a string, got None"):
    data.local_corpus([str(tmp_path / "null.jsonl")])


def _take(it, n):
  for _ in range(n):
    yield next(it)


def test_validation_split_is_disjoint_from_training():
  """Held-out documents never reach training rows: the last 5% of the documents use letters
  n-z, the rest a-m; decoded training rows hold no n-z, validation rows no a-m."""
  rs = np.random.RandomState(0)
  words = lambda letters: " ".join("".join(rs.choice(list(letters), 5)) for _ in range(30))
  docs = [words("abcdefghijklm") for _ in range(38)] + [words("nopqrstuvwxyz") for _ in range(2)]
  td = data.prepare(docs, 300, (16, 32), val_fraction=0.05)
  text = lambda rows: "".join(td.tokenizer.decode(list(map(int, r))) for r in rows)
  train = "".join(text(rows) for rows in td.rows.values())
  val = text(td.val)
  assert set(train) & set("nopqrstuvwxyz") == set() and set(train) & set("abcdefghijklm")
  assert set(val) & set("abcdefghijklm") == set() and set(val) & set("nopqrstuvwxyz")
