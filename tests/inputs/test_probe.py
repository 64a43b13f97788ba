"""The verification probe: real text through the model's tokenizer wherever one is known, random ids
only as the fallback, and the report says which."""

import warnings

import pytest
import torch
import transformers as tf

import normswap
from normswap import inputs, pipeline, presets
from normswap.surgery import verify
from tests.zoo import EXACT, build


def _spy_compare(monkeypatch) -> list[dict]:
    """Record what verification compares: output shapes and the attention mask it was given."""
    calls: list[dict] = []
    real = pipeline.compare

    def spy(reference, converted, skip=frozenset(), attention_mask=None, axes=None):
        calls.append({"shape": tuple(converted.logits.shape[:2]), "mask": attention_mask})
        return real(reference, converted, skip, attention_mask, axes)

    monkeypatch.setattr(pipeline, "compare", spy)
    return calls


def _expected_rows(tok, limit: int = inputs.PROBE_MAX_TOKENS) -> list[list[int]]:
    """The built-in passages encoded by the tokenizer itself, truncated (by the tokenizer, special
    tokens kept) at the lengths the probe documents."""
    texts = inputs.passages(inputs.PROBE_BATCH, 0, from_end=True)
    n = len(texts)
    return [tok(t, truncation=True, max_length=limit * (n - i) // n)["input_ids"] for i, t in enumerate(texts)]


def test_a_given_tokenizer_makes_the_probe_real_padded_text(monkeypatch):
    """Fails if verification silently fell back to random ids: the model must have been compared on
    exactly the tokenizer's encoding of the built-in passages, padded, with its attention mask."""
    model, tok = presets.build("tiny-gpt2", dtype=torch.float64)
    calls = _spy_compare(monkeypatch)
    report = normswap.patch(model, tokenizer=tok)

    probe = report.verification["probe"]
    assert probe.startswith("built-in English text") and "the tokenizer passed in" in probe
    assert "right-padded with an attention mask" in probe
    rows = _expected_rows(tok)
    mask = calls[0]["mask"]
    assert mask is not None, "no attention mask: the probe was not tokenised text"
    assert mask.sum(1).tolist() == [len(r) for r in rows]
    assert 0 in mask and calls[0]["shape"] == (len(rows), max(len(r) for r in rows))
    assert report.verification["max_rel_error"] < 1e-12 and report.verification["top1_agreement"] == 1.0
    assert "verified on: built-in English text" in str(report)


def test_the_probe_ids_are_the_tokenizers_own():
    model, tok = presets.build("tiny-bert", dtype=torch.float64)
    probe = inputs.verification_probe(model, tok)
    assert probe.text and probe.kwargs["attention_mask"].dtype == torch.long
    for ids, mask, row in zip(probe.kwargs["input_ids"], probe.kwargs["attention_mask"], _expected_rows(tok),
                              strict=True):
        assert ids[mask.bool()].tolist() == row
        assert row[0] == tok.cls_token_id and row[-1] == tok.sep_token_id  # special tokens as the tokenizer adds
        assert set(ids[~mask.bool()].tolist()) <= {tok.pad_token_id}


def test_left_padding_is_the_tokenizers_choice():
    model, tok = presets.build("tiny-gpt2", dtype=torch.float64)
    tok.padding_side = "left"
    probe = inputs.verification_probe(model, tok)
    mask = probe.kwargs["attention_mask"]
    assert "left-padded" in probe.source and bool(mask[:, -1].all()) and not bool(mask[:, 0].all())
    assert normswap.patch(model, tokenizer=tok).verification["max_rel_error"] < 1e-12


def test_a_preset_model_finds_its_own_tokenizer():
    model, _ = presets.build("tiny-opt", dtype=torch.float64)
    report = normswap.patch(model)
    assert report.verification["probe"].startswith("built-in English text")
    assert "tiny-opt preset's tokenizer" in report.verification["probe"]


def test_a_model_loaded_from_a_directory_uses_the_tokenizer_there(tmp_path):
    presets.save("tiny-phi", tmp_path / "phi")
    model = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "phi", dtype=torch.float64).eval()
    report = normswap.patch(model)
    assert "tokenizer in the model's directory" in report.verification["probe"]


def test_encoder_decoder_gets_the_text_on_both_sides():
    tok = presets.tokenizer("tiny-gpt2")
    config = tf.BartConfig(vocab_size=len(tok), d_model=32, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=0,
                           eos_token_id=0, decoder_start_token_id=0)
    model = tf.BartForConditionalGeneration(config).eval().double()
    probe = inputs.verification_probe(model, tok)
    assert probe.text
    assert torch.equal(probe.kwargs["decoder_input_ids"], probe.kwargs["input_ids"])
    assert torch.equal(probe.kwargs["decoder_attention_mask"], probe.kwargs["attention_mask"])


def test_without_a_tokenizer_the_fallback_is_random_ids_and_says_so():
    report = normswap.patch(build(EXACT, "gpt2"))
    assert report.verification["probe"] == "random token ids drawn over the vocabulary (no tokenizer given or found)"
    vit = tf.ViTForImageClassification(tf.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32)).eval()
    probe = inputs.verification_probe(vit)
    assert probe.source == inputs.GENERATED_IMAGES  # images with structure, not white noise
    pixels = probe.kwargs["pixel_values"].double()
    # neighbouring pixels of a generated image are correlated; white noise's are not
    across = torch.corrcoef(torch.stack([pixels[..., :, :-1].flatten(), pixels[..., :, 1:].flatten()]))[0, 1]
    assert across > 0.5, across


def test_a_custom_model_is_verified_on_held_out_inputs_and_the_report_says_so(monkeypatch):
    """Fails if a custom model were verified on the very inputs the analysis ran on: the converted model
    must have been run on inputs of the example's shape but other values, and the report says so."""
    from tests.custom_models import TinyViT, randomise

    example = torch.randn(2, 3, 32, 32, dtype=torch.float64) * 0.5 + 0.2
    seen: list[torch.Tensor] = []
    model = randomise(TinyViT())
    model.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    report = normswap.patch(model, (example,))
    assert report.verification["probe"].startswith("the example inputs redrawn from seed")
    assert "unseen_probe_max_rel_error" in report.verification
    held_out = [x for x in seen if x.shape == example.shape and not torch.equal(x, example)]
    assert held_out, "no forward on redrawn inputs"
    x = held_out[0]
    assert abs(float(x.mean()) - 0.2) < 0.05 and abs(float(x.std()) - 0.5) < 0.05  # same statistics


def test_held_out_inputs_keep_masks_positions_and_ids_in_range():
    from normswap.inputs.probe import call_args, held_out_like

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 40, (2, 9), generator=gen)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    positions = torch.arange(9).expand(2, 9)
    grid = torch.tensor([[1, 4, 4]])
    probe = held_out_like((ids,), {"attention_mask": mask, "position_ids": positions, "image_grid_thw": grid,
                                   "scale": torch.full((2, 1), 0.5), "flag": True})
    args, kwargs = call_args(probe.kwargs)
    assert args[0].shape == ids.shape and args[0].dtype == ids.dtype and not torch.equal(args[0], ids)
    assert int(args[0].min()) >= 5 and int(args[0].max()) <= 39
    given = {"attention_mask": mask, "position_ids": positions, "image_grid_thw": grid,
             "scale": torch.full((2, 1), 0.5)}
    for name, value in given.items():
        assert torch.equal(kwargs[name], value), name
    assert kwargs["flag"] is True and probe.attention_mask is mask
    assert held_out_like((), {"attention_mask": mask}) is None  # nothing to redraw: no probe


def test_held_out_ids_keep_special_tokens_and_placeholder_runs():
    """A vision-language prompt: its image placeholder run and special ids stay where they are (the model
    counts them against its image features); the text around them is redrawn."""
    from normswap.inputs.probe import call_args, held_out_like, special_ids

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 90, (2, 30), generator=gen)
    ids[:, 0] = 1  # bos
    ids[:, 5:15] = 95  # an image placeholder run
    ids[1, 25:] = 0  # padding
    args, _ = call_args(held_out_like((ids,), {}, keep_ids={0, 1}).kwargs)
    new = args[0]
    assert torch.equal(new[:, 0], ids[:, 0]) and torch.equal(new[:, 5:15], ids[:, 5:15])
    assert torch.equal(new[1, 25:], ids[1, 25:])
    free = torch.ones_like(ids, dtype=torch.bool)
    free[:, 0] = free[:, 5:15] = False
    free[1, 25:] = False
    assert not torch.equal(new[free], ids[free])
    assert not torch.isin(new[free], torch.tensor([0, 1, 95])).any()
    config = tf.LlavaConfig(text_config=tf.LlamaConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2),
                            image_token_index=95)
    assert {0, 1, 2, 95} <= special_ids(type("M", (), {"config": config})())


def test_a_tokenizer_that_does_not_fit_the_model_warns_and_falls_back():
    model = build(EXACT, "gpt2")  # vocabulary of 99; the preset tokenizer's ids go up to 319
    with pytest.warns(UserWarning, match="cannot make the verification probe"):
        probe = inputs.verification_probe(model, presets.tokenizer("tiny-gpt2"))
    assert not probe.text and "outside the model's vocabulary of 99" in probe.source
    assert probe.source.startswith("random token ids")


def test_figures_count_real_tokens_only():
    ref = torch.randn(2, 5, 7, dtype=torch.float64)
    out = ref.clone()
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    out[0, 3:] += 10.0  # wrong only where the mask says padding
    masked = verify.compare({"logits": ref}, {"logits": out}, attention_mask=mask)
    assert masked["max_rel_error"] == 0.0 and masked["top1_agreement"] == 1.0
    assert verify.compare({"logits": ref}, {"logits": out})["max_rel_error"] > 1.0
    assert verify.real_tokens(ref, mask).shape == (8, 7)


def test_convert_and_verify_report_the_probe(tmp_path):
    from normswap.checkpoint.verify_dirs import verify_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.convert("tiny-gpt2", tmp_path / "out")
    assert report.verification["probe"].startswith("built-in English text")
    assert "Probe inputs: built-in English text" in (tmp_path / "out" / "README.md").read_text()
    result = verify_checkpoint("tiny-gpt2", tmp_path / "out")  # normswap verify ORIGINAL CONVERTED
    assert result["ok"] and result["batches"] == 2
    assert result["probe"].startswith("built-in English text") and "random inputs" in result["probe"]


def test_a_model_loaded_by_hub_id_finds_its_tokenizer_in_the_local_cache(tmp_path, monkeypatch):
    """``from_pretrained("org/name")`` leaves the tokenizer in the Hugging Face cache; the probe (and the
    built-in calibration, which asks the same function) must use it, offline, rather than random ids.
    The cache here is a hand-made one in the layout huggingface_hub writes (no network)."""
    import huggingface_hub.constants

    model, tok = presets.build("tiny-bert", dtype=torch.float64)
    repo = tmp_path / "models--someone--tiny-bert"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    tok.save_pretrained(snapshot)
    model.config.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))

    model.config._name_or_path = "someone/tiny-bert"
    probe = inputs.verification_probe(model)
    assert probe.text and "someone/tiny-bert tokenizer in the Hugging Face cache" in probe.source
    assert [r[:m.sum()].tolist() for r, m in zip(probe.kwargs["input_ids"], probe.kwargs["attention_mask"],
                                                  strict=True)] == _expected_rows(tok)

    model.config._name_or_path = "someone/not-downloaded"  # not in the cache: the random fallback, no error
    assert not inputs.verification_probe(model).text


def test_a_directory_without_tokenizer_files_is_not_real_text(tmp_path):
    """transformers 5 builds a BERT tokenizer of 5 special tokens from a directory that has only a
    config.json: every word becomes [UNK]. The probe and the built-in calibration must not call that
    "real text"; a directory with the tokenizer saved beside the model keeps it."""
    from normswap.surgery import calibrate

    model, tok = presets.build("tiny-bert", dtype=torch.float64)
    model.save_pretrained(tmp_path / "bare")
    bare = tf.BertForMaskedLM.from_pretrained(tmp_path / "bare").double()
    assert inputs.find_tokenizer(bare) is None
    assert not inputs.verification_probe(bare).text
    assert "no tokenizer" in calibrate.builtin_batches(bare, batches=1)[1]
    tok.save_pretrained(tmp_path / "bare")
    with_tokenizer = tf.BertForMaskedLM.from_pretrained(tmp_path / "bare").double()
    assert inputs.understands_text(tok) and inputs.verification_probe(with_tokenizer).text


def test_a_tokenizer_of_another_domain_is_kept_but_not_fed_english():
    """A word-level tokenizer of another vocabulary (the recipes' toy grammar) is a real tokenizer (the
    CLI tokenises the user's calibration text with it), but the built-in English sentences come out of
    it as [UNK]s: the probe and the built-in calibration use random ids instead, and say why."""
    from normswap.recipes import toy
    from normswap.surgery import calibrate

    tok = toy.word_tokenizer(toy.grammar_corpus(50))
    assert inputs.has_vocabulary(tok) and not inputs.understands_text(tok)
    model = tf.BertForMaskedLM(tf.BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=32)).eval()
    probe = inputs.verification_probe(model, tok)
    assert not probe.text and "reads most built-in English words as unknown" in probe.source
    assert "reads most built-in English words as unknown" in calibrate.builtin_batches(model, tok, batches=1)[1]


def test_a_held_out_probe_the_model_outputs_nan_on_is_not_used():
    """Redrawn inputs can leave the model's domain (here: a log of a negative value): NaN compares as "no
    error", so that probe is dropped, the traced inputs verify, and the report says why."""

    class LogNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.head = torch.nn.Linear(8, 4)

        def forward(self, x):  # noqa: ANN001, ANN201
            return self.head(self.norm(self.proj(torch.log(x))))

    x = torch.rand(16, 8, dtype=torch.float64) + 1e-4  # positive; the redraw (same mean and std) is not
    report = normswap.patch(LogNet().double(), (x,))
    assert report.verification["probe"] == ("the analysis inputs (the unseen probe did not run: the original "
                                            "outputs NaN or inf on it)")
    assert report.verification["max_rel_error"] < 1e-12
