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
