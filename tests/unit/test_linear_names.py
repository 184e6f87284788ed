"""The quantizable linears' names: their kind and layer read back from a name."""

import pytest

from autoglm_trt.graph.names import in_layer, kind_of, layer_of


@pytest.mark.parametrize(("name", "kind", "layer"), [
    (in_layer(3, "down"), "down", 3), (in_layer(39, "gate_up"), "gate_up", 39), ("lm_head", "lm_head", None),
    ("layers.x", "x", None)])
def test_a_linears_kind_and_layer(name, kind, layer):
    assert kind_of(name) == kind and layer_of(name) == layer
