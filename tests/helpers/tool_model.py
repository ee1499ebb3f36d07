"""The tiny model taught (by overfitting) one tool call: asked ASK with the calculator's schema in
the system prompt (as a ToolEnv shows it), it answers CALL_TEXT. For tests of what surrounds a
tool call (the OpenAI API's ``tool_calls``, the chat's tool display) with a real model."""

from __future__ import annotations

import shutil
from pathlib import Path

from agent_r1.agent.tool_calls import format_tool_call

ASK = [{"role": "user", "content": "What is 12 * 7?"}]
CALL_TEXT = format_tool_call("calculator", {"expression": "12 * 7"})


def teach_tool_call(tiny_model_dir: Path, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from agent_r1.agent.chat import ChatCodec
    from agent_r1.agent_tools import TOOLS

    shutil.copytree(tiny_model_dir, out)
    codec = ChatCodec.load(str(out))
    prompt = codec.encode_chat(ASK, [TOOLS.get("calculator")().schema])
    target = codec.encode(CALL_TEXT) + [codec.im_end_id]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([prompt + target])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(200):
        loss = model(ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1e-3:
            break
    model.save_pretrained(out)
    return out
