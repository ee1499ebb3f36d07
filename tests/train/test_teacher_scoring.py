"""OPD teacher scoring reads SGLang's input logprobs as upstream returns them: the first position
of ``logprob_start_len`` comes back ``null``."""

import asyncio
from types import SimpleNamespace

import pytest

from agent_r1.train.worker import teacher_logprobs


class UpstreamShaped:
    """Answers like SGLang: one entry per input position from logprob_start_len on, the first null,
    position i scored as -i (so which positions were kept is visible)."""

    def __init__(self, null_at=()):
        self.bodies, self.null_at = [], set(null_at)

    async def generate_raw(self, body, session=None):
        self.bodies.append(body)
        ids, start = body["input_ids"], body["logprob_start_len"]
        entries = [[None if i == start or i in self.null_at else -float(i), ids[i], None]
                   for i in range(start, len(ids))]  # fmt: skip
        return {"meta_info": {"input_token_logprobs": entries}}


def step(obs, act):
    return SimpleNamespace(obs_token_ids=obs, action_token_ids=act, trajectory_id="t0", step_index=0)


def test_every_action_token_gets_its_own_logprob_and_the_null_is_never_read():
    client = UpstreamShaped()
    traj = SimpleNamespace(steps=[step([7, 8, 9], [4, 5]), step([1], [2, 3, 6])])
    got = asyncio.run(teacher_logprobs(client, [traj]))
    assert got == [[-3.0, -4.0], [-1.0, -2.0, -3.0]]  # the action's input positions
    assert [b["logprob_start_len"] for b in client.bodies] == [2, 0]


def test_a_missing_teacher_logprob_is_an_error_naming_the_step():
    traj = SimpleNamespace(steps=[step([7, 8, 9], [4, 5])])
    with pytest.raises(RuntimeError, match="no logprob for an action token \\(t0 step 0\\)"):
        asyncio.run(teacher_logprobs(UpstreamShaped(null_at={4}), [traj]))
