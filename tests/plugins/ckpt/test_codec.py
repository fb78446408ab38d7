"""State dicts to JSON trees and tensors and back; what cannot be stored without pickle is refused."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from stead.plugins.ckpt._codec import decode, encode
from stead.plugins.ckpt.errors import UnsupportedState


def roundtrip(state: dict[str, Any]) -> Any:
    encoded = encode(state)
    tree = json.loads(json.dumps(encoded.tree))  # what survives the trip through shared memory or disk
    return decode(tree, lambda i, _path: encoded.tensors[i].clone(), where="test")


def test_nested_values_keep_their_types() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3, "lr": 0.5, "name": "run",
             "done": False, "none": None, "pair": (1, "a"), "nan": math.nan, "steps": [1, 2, [3]]}
    back = roundtrip(state)
    assert torch.equal(back["model"]["weight"], model.weight)
    assert set(back["optim"]["state"]) == {0, 1}  # int keys stay ints
    assert torch.equal(back["optim"]["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert back["optim"]["param_groups"][0]["params"] == [0, 1]
    assert back["pair"] == (1, "a") and back["steps"] == [1, 2, [3]] and math.isnan(back["nan"])
    assert back["epoch"] == 3 and back["done"] is False and back["none"] is None


@pytest.mark.parametrize(("value", "words"), [
    (object(), "builtins.object"),
    (b"raw", "builtins.bytes"),
    ({1, 2}, "builtins.set"),
    ({(1, 2): 3}, "key (1, 2)"),
    ({True: 1}, "key True"),
    (torch.ones(2).to_sparse(), "to_dense()"),
])
def test_values_that_need_pickle_are_refused_with_the_path_and_a_remedy(value: object, words: str) -> None:
    with pytest.raises(UnsupportedState) as caught:
        encode({"outer": {"inner": value}})
    message = str(caught.value)
    assert words in message and "['outer']" in message


@pytest.mark.parametrize("tree", [{"x": 1}, {"d": [["k"]]}, {"t": "0"}, {"v": {"a": 1}}, [1],
                                  {"d": [[True, {"v": 1}]]}])
def test_malformed_trees_are_refused(tree: object) -> None:
    with pytest.raises(UnsupportedState):
        decode({"d": [["a", tree]]}, lambda i, _path: torch.zeros(1), where="test")
