"""The embedded default model: its corpus, the shipped checkpoint, and the exact-HF-layout export."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from text_generation_server import about
from text_generation_server.jobs import corpus

# The trainer is a script beside the package, not part of it: it made the shipped model once.
TRAINER = Path(__file__).resolve().parents[1] / "scripts" / "train_embedded.py"
_spec = importlib.util.spec_from_file_location("train_embedded", TRAINER)
assert _spec is not None and _spec.loader is not None
train_embedded = importlib.util.module_from_spec(_spec)
sys.modules["train_embedded"] = train_embedded  # dataclasses look their module up there
_spec.loader.exec_module(train_embedded)
EOS_ID, load_exported = train_embedded.EOS_ID, train_embedded.load_exported

transformers = pytest.importorskip("transformers", reason="transformers is the test-time reference for HF layout")

ASSET = Path(about.__file__).parent / "assets" / "tiny-pycoder"
# Measured on the shipped model: 31.9 on the first 4096 held-out tokens (chance is 4096,
# a unigram model of the stdlib scores ~800). The bound leaves ~40% margin for another
# Python's stdlib, yet fails for an untrained, mis-loaded or mis-tokenized model.
PERPLEXITY_BOUND = 45.0


# ----------------------------------------------------------------- corpus ----


def test_splits_are_disjoint_nonempty_and_cover_the_stdlib() -> None:
    train = corpus.corpus_files("train")
    heldout = corpus.corpus_files("heldout")
    assert train and heldout
    assert not set(train) & set(heldout)
    assert len(heldout) < 0.1 * len(train)
    everything = set(train) | set(heldout)
    root = corpus.stdlib_root()
    assert root / "os.py" in everything
    assert not any("site-packages" in p.relative_to(root).parts for p in everything)
    for files in (train, heldout):
        rel = [p.relative_to(root).as_posix() for p in files]
        assert rel == sorted(rel)


def test_split_assignment_is_deterministic() -> None:
    assert corpus.corpus_files("heldout") == corpus.corpus_files("heldout")
    # The hash is of the relative path only, so these assignments hold on every machine.
    for rel in ("os.py", "asyncio/futures.py", "json/decoder.py"):
        assert corpus.split_of(rel) == corpus.split_of(rel)
    assert corpus.split_of("asyncio/futures.py") == "heldout"
    assert corpus.split_of("os.py") == "train"
    heldout_share = sum(corpus.split_of(f"m{i}.py") == "heldout" for i in range(20_000)) / 20_000
    assert 0.02 < heldout_share < 0.04


def test_corpus_text_joins_documents_with_eos_and_truncates() -> None:
    text = corpus.corpus_text("heldout", max_chars=300_000)
    assert len(text) == 300_000
    assert text.count(corpus.EOS_TEXT) >= 1
    first = corpus.read_document(corpus.corpus_files("heldout")[0])
    assert text.startswith(first)
    assert corpus.corpus_text("heldout", max_chars=1000) == text[:1000]


@pytest.mark.parametrize("split", ["test", "Train", "", "validation"])
def test_bad_split_names_raise(split: str) -> None:
    with pytest.raises(ValueError, match="split"):
        corpus.corpus_files(split)
    with pytest.raises(ValueError, match="split"):
        corpus.corpus_text(split)


def test_bad_max_chars_raises() -> None:
    with pytest.raises(ValueError, match="max_chars"):
        corpus.corpus_text("train", max_chars=0)


# ---------------------------------------------------------- shipped model ----


@pytest.fixture(scope="module")
def shipped_model():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM.from_pretrained(ASSET, torch_dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    return model, tokenizer


def test_shipped_folder_is_complete_and_small() -> None:
    names = {p.name for p in ASSET.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "training.json"} <= names
    assert sum(p.stat().st_size for p in ASSET.iterdir()) < 12 * 2**20
    config = json.loads((ASSET / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "bfloat16"
    assert config["eos_token_id"] == EOS_ID
    assert json.loads((ASSET / "generation_config.json").read_text())["eos_token_id"] == EOS_ID
    report = json.loads((ASSET / "training.json").read_text())
    for key in ("command", "seed", "wall_time_s", "steps", "tokens_seen", "final_train_loss",
                "heldout_perplexity", "heldout_bits_per_byte", "parameters"):
        assert key in report


def test_shipped_tokenizer_round_trips_python(shipped_model) -> None:
    _, tokenizer = shipped_model
    assert tokenizer.token_to_id(corpus.EOS_TEXT) == EOS_ID
    odd = "def f(x):\n\treturn {'a': x ** 2}  # ünïcode ✓ 𝔘\r\n"
    assert tokenizer.decode(tokenizer.encode(odd).ids) == odd  # byte-level: nothing is lost
    source = "import os\n\n\ndef main(argv=None):\n    for name in os.listdir(path):\n        self.assertEqual(name, None)\n    return 0\n"
    enc = tokenizer.encode(source)
    assert enc.ids[0] != EOS_ID  # no BOS is added
    assert tokenizer.decode(enc.ids) == source
    assert len(enc.ids) < len(source.encode()) / 3  # merges learned from Python source


def test_shipped_model_heldout_perplexity_far_below_chance(shipped_model) -> None:
    model, tokenizer = shipped_model
    vocab = model.config.vocab_size
    ids = tokenizer.encode(corpus.corpus_text("heldout", max_chars=40_000)).ids[:4096]
    assert len(ids) == 4096
    windows = torch.tensor(ids).view(16, 256)
    with torch.no_grad():
        logits = model(windows).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), windows[:, 1:].reshape(-1))
    perplexity = math.exp(nll.item())
    assert perplexity < vocab / 4
    assert perplexity < PERPLEXITY_BOUND, f"held-out perplexity {perplexity:.2f}"


def test_shipped_model_greedy_continuation_is_python(shipped_model) -> None:
    model, tokenizer = shipped_model
    prompt = torch.tensor([tokenizer.encode("import os\n").ids])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    text = tokenizer.decode(out[0].tolist())
    assert text.startswith("import os\n")
    assert any(word in text[10:] for word in ("import", "def ", "from ", "=", "class ", "#"))


# ----------------------------------------------------------------- export ----


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory) -> Path:
    """A few steps of the real script on a tiny, deliberately non-default config.

    rope_theta, rms_norm_eps and a head_dim unequal to hidden/heads all differ from
    LlamaConfig defaults, so a config key transformers failed to read would show.
    """
    out = tmp_path_factory.mktemp("tiny-export")
    cmd = [
        sys.executable, str(TRAINER), "--output", str(out),
        "--max-steps", "6", "--vocab-size", "384", "--hidden-size", "48", "--heads", "4", "--head-dim", "16",
        "--kv-heads", "2", "--intermediate-size", "80", "--layers", "2", "--seq-len", "32", "--batch-size", "4",
        "--max-position-embeddings", "64", "--rope-theta", "300", "--rms-norm-eps", "1e-4", "--lr", "3e-2",
        "--warmup-steps", "2", "--max-corpus-chars", "150000", "--eval-tokens", "1000", "--precision", "fp32",
        "--threads", "1",
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return out


def test_tiny_export_writes_hf_layout(tiny_export: Path) -> None:
    from safetensors import safe_open

    with safe_open(tiny_export / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names)
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(2):
        expected |= {f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        expected |= {f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"}
    assert names == expected
    report = json.loads((tiny_export / "training.json").read_text())
    assert report["steps"] == 6 and report["tokens_seen"] == 6 * 4 * 32


def test_tiny_export_logits_match_transformers(tiny_export: Path) -> None:
    torch.manual_seed(0)
    ours = load_exported(tiny_export)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tiny_export, torch_dtype=torch.float32).eval()
    assert theirs.config.head_dim == 16 and theirs.config.num_key_value_heads == 2
    ids = torch.randint(0, 384, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # The comparison is sensitive: the same weights with a different RoPE base diverge.
    config = json.loads((tiny_export / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"] = 10000.0
    wrong = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    wrong.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        assert (wrong(ids).logits - expected).abs().max() > 1e-3
