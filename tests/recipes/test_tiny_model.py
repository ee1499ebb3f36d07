import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_r1.models.tiny import build_tiny_model


@pytest.mark.parametrize(
    "arch,cls", [("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")]
)
def test_build_and_reload(tmp_path, arch, cls):
    texts = ["Ava has 3 apples. Then Ava finds 4 more apples."] * 20
    out = build_tiny_model(
        tmp_path / arch, texts, arch=arch, vocab_size=300, hidden=32, layers=1, heads=2, kv_heads=1
    )
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == cls and model.config.vocab_size == len(tok)
    text = "Ava has 37 apples. <tool_call>{}</tool_call> ✓"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "x"}], tokenize=False
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tok.encode("Ava has", add_special_tokens=False)])).logits
    assert logits.shape[-1] == len(tok) and torch.isfinite(logits).all()


def test_bad_arch(tmp_path):
    with pytest.raises(ValueError, match="arch must be one of"):
        build_tiny_model(tmp_path, ["a b c"] * 5, arch="gpt5", vocab_size=300)


@pytest.mark.parametrize(
    "arch,cls",
    [("qwen2_vl", "Qwen2VLForConditionalGeneration"), ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration")],
)
def test_build_a_vision_model(tmp_path, arch, cls):
    from transformers import AutoModelForImageTextToText

    from agent_r1.agent.chat import ChatCodec

    texts = ["The picture shows 37 apples. Then Ava finds 4 more apples."] * 20
    out = build_tiny_model(tmp_path / arch, texts, arch=arch, vocab_size=300, split_digits=True)
    model = AutoModelForImageTextToText.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == cls and model.config.text_config.vocab_size == len(tok)
    vocab = tok.get_vocab()
    assert model.config.image_token_id == vocab["<|image_pad|>"]
    assert model.config.vision_start_token_id == vocab["<|vision_start|>"]
    assert [tok.decode([i]) for i in tok.encode("37", add_special_tokens=False)] == ["3", "7"]  # digits split
    codec = ChatCodec.load(str(out))
    assert codec.vision is not None and codec.vision.max_pixels == 112 * 112
    with pytest.raises(ValueError, match="speaks ChatML"):
        build_tiny_model(tmp_path / "x", texts, arch=arch, vocab_size=300, chat_format="llama3")
