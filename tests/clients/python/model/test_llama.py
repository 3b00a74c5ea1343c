"""The numpy SmolLM2 forward pass on the real weights: architecture from the GGUF metadata,
tokenizer, coherent greedy output, perplexity on English text, and block-prefill equivalence."""

import os
import random

import numpy as np

from numpy_llama import LocalKVCache, log_softmax, perplexity

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
ALICE = os.path.join(REPO, "bench", "quality", "data", "alice_ch1.txt")


def _alice_tokens(tokenizer, n):
    with open(ALICE, encoding="utf-8") as f:
        return tokenizer.encode(f.read())[:n]


def test_architecture_comes_from_metadata(model):
    c = model.cfg
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.d_ff, c.vocab_size, c.context_length) == (1536, 49152, 8192)
    assert c.rope_base == 100000.0 and c.tied_embeddings
    assert model.w.layers[0].wqkv.shape == (576, (9 + 2 * 3) * 64)


def test_tokenizer_round_trip_and_control_tokens(tokenizer):
    text = "Hello world! The year 2024 has 366 days."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # SmolLM's pre-tokenizer splits every digit on its own.
    assert [tokenizer.decode([i]) for i in tokenizer.encode("2024")] == ["2", "0", "2", "4"]
    # Control tokens are matched verbatim, not split into bytes.
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == tokenizer.im_end_id == 2
    assert tokenizer.decode(ids) == "user\nhi"


def _chat(model, tokenizer, question, n):
    prompt = tokenizer.encode(tokenizer.chat_prompt(question))
    gen = model.generate(prompt, LocalKVCache(model.cfg), n,
                         stop_ids=[tokenizer.im_end_id, tokenizer.eos_id])
    return tokenizer.decode(gen.tokens)


def test_greedy_answer_is_coherent(model, tokenizer):
    assert _chat(model, tokenizer, "What is the capital of France?", 12) == \
        "The capital of France is Paris."


def test_greedy_list_continues_correctly(model, tokenizer):
    text = _chat(model, tokenizer, "List the days of the week.", 24)
    for day in ("Monday", "Tuesday", "Wednesday"):
        assert day in text, text
    assert text.index("Monday") < text.index("Tuesday") < text.index("Wednesday")


def test_perplexity_of_english_text_is_sane(model, tokenizer):
    ids = _alice_tokens(tokenizer, 160)
    ppl = perplexity(model, ids, block_size=64)
    assert 5.0 < ppl < 60.0, ppl
    # The same words shuffled are far less likely: the model reads the text, not word counts.
    words = tokenizer.decode(ids).split()
    random.Random(0).shuffle(words)
    shuffled = tokenizer.encode(" ".join(words))[: len(ids)]
    assert perplexity(model, shuffled, block_size=64) > 5 * ppl


def test_block_prefill_equals_one_shot_prefill(model, tokenizer):
    ids = _alice_tokens(tokenizer, 48)
    one_cache = LocalKVCache(model.cfg)
    one = model.prefill(ids, one_cache, block_size=len(ids), all_logits=True)
    for block in (16, 5):
        cache = LocalKVCache(model.cfg)
        blocks = model.prefill(ids, cache, block_size=block, all_logits=True)
        assert blocks.shape == one.shape == (48, model.cfg.vocab_size)
        np.testing.assert_allclose(blocks, one, atol=2e-3, rtol=0)
        assert (blocks.argmax(-1) == one.argmax(-1)).all()
        for layer in (0, 29):
            k1, v1, p1 = one_cache.get_committed(layer)
            k2, v2, p2 = cache.get_committed(layer)
            np.testing.assert_allclose(k2, k1, atol=1e-4)
            np.testing.assert_allclose(v2, v1, atol=1e-4)
            assert (p1 == p2).all()


def test_decode_steps_match_prefill_logits(model, tokenizer):
    ids = _alice_tokens(tokenizer, 40)
    full = model.prefill(ids, LocalKVCache(model.cfg), block_size=64, all_logits=True)
    cache = LocalKVCache(model.cfg)
    model.prefill(ids[:32], cache, block_size=32)
    for i in range(32, 40):
        step = model.forward([ids[i]], [i], cache)
        np.testing.assert_allclose(step, full[i], atol=2e-3, rtol=0)
    # A decode step sees only earlier tokens: the next-token distribution is a proper one.
    lp = log_softmax(full[-1])
    assert abs(np.exp(lp).sum() - 1.0) < 1e-6
