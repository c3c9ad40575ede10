"""A published student policy, scored samples for the teacher, and what a teacher model makes of them."""
from __future__ import annotations

import torch

from rlstream.models.tiny import build_model, build_tokenizer, save_pretrained
from rlstream.policy.weights import WeightStore, tokenizer_hash
from rlstream.schemas import headers as hdr
from rlstream.schemas.records import PolicyVersion, Reward, ScoredTrajectory
from tests.helpers.kafka import make_trajectory, produce

RESPONSE = [7, 6, 5, 2]


def publish_student(bootstrap, run, tmp_path, version=0, seed=3):
    tok = build_tokenizer()
    model = build_model(tok, seed=seed)
    uri = WeightStore(str(tmp_path / "w")).put("policy", version, lambda d: save_pretrained(model, tok, d))
    folder = tmp_path / "w" / "policy" / f"v{version}"
    pv = PolicyVersion(policy="policy", version=version, weights_uri=uri, created_at=hdr.now_ms(),
                       published_at=hdr.now_ms(), tokenizer_hash=tokenizer_hash(folder))
    produce(bootstrap, run, "policy-versions", [(b"policy", pv, None)])
    return model, tok, folder


def samples(tok, first: int, n: int):
    out = []
    for i in range(first, first + n):
        traj = make_trajectory(i, n_tokens=4)
        traj.task.prompt_token_ids = tok("abc>")["input_ids"]
        traj.token_ids = list(RESPONSE)
        traj.loss_mask = [1, 1, 0, 1]  # an observation token in the middle gets no teacher signal
        out.append((traj.group_id.encode(), ScoredTrajectory(traj, Reward(1.0, "v1")), None))
    return out


def expected(model, tok, k=4):
    """The model's log-probs of RESPONSE after the prompt, and its top-k, laid out as feedback carries them."""
    seq = torch.tensor([tok("abc>")["input_ids"] + RESPONSE])
    with torch.no_grad():
        full = torch.log_softmax(model(seq).logits[0, :-1].float(), -1)
    lp = full.gather(-1, seq[0, 1:, None])[:, 0]
    top = full.topk(k, -1)
    p = len(tok("abc>")["input_ids"])
    lps, ids, tlps = [], [], []
    for j, m in enumerate([1, 1, 0, 1]):
        lps.append(float(lp[p + j - 1]) if m else 0.0)
        ids += top.indices[p + j - 1].tolist() if m else [0] * k
        tlps += top.values[p + j - 1].tolist() if m else [0.0] * k
    return lps, ids, tlps
