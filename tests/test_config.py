"""KVQuantConfig: presets, JSON round trip, and clear errors for bad input."""

import dataclasses
import json

import pytest
import torch

from kvq_ao.config import FP, PRESETS, DepthSpan, KVQuantConfig, LayerKV, QuantSpec


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_json(name, tmp_path):
    cfg = KVQuantConfig.preset(name)
    path = tmp_path / "cfg.json"
    cfg.save(path)
    assert KVQuantConfig.load(path) == cfg


def test_kivi_presets_follow_kivi():
    """KIVI's layouts; kivi-4's keys scored against an int16 query (docs/integer_scores.md)."""
    for bits in (2, 4):
        cfg = KVQuantConfig.preset(f"kivi-{bits}")
        assert cfg.default.key == QuantSpec(bits, "channel", 32, scores="int16" if bits == 4 else "float")
        assert cfg.default.value == QuantSpec(bits, "token", 32)
        assert cfg.residual_length == 128


def test_per_layer_config_round_trips_and_resolves(tmp_path):
    layers = [LayerKV(QuantSpec(8), QuantSpec(4)), LayerKV(QuantSpec(2, "channel"), QuantSpec(None))]
    cfg = KVQuantConfig(layers=tuple(layers), sink_tokens=1, name="mixed")
    cfg.save(tmp_path / "m.json")
    again = KVQuantConfig.load(tmp_path / "m.json")
    assert again == cfg and again.resolve(2) == tuple(layers)
    assert json.loads((tmp_path / "m.json").read_text())["layers"][1]["value"]["bits"] == "none"


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown preset 'kivi-5'.*kivi-4"):
        KVQuantConfig.preset("kivi-5")


@pytest.mark.parametrize("bits", [1, 5, 16, 0, "4", True])
def test_bits_outside_the_allowed_set_are_rejected(bits):
    with pytest.raises(ValueError, match="bits must be one of"):
        QuantSpec(bits=bits)


def test_bad_axis_group_and_lengths_are_rejected():
    with pytest.raises(ValueError, match="axis must be one of"):
        QuantSpec(4, axis="row")
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        QuantSpec(4, group_size=0)
    with pytest.raises(ValueError, match="residual_length must be a non-negative int"):
        KVQuantConfig(residual_length=-1)
    with pytest.raises(ValueError, match="sink_tokens .* must be smaller than the per-channel token group"):
        KVQuantConfig(default=LayerKV(QuantSpec(4, "channel", 8)), sink_tokens=8)


def test_group_not_dividing_head_dim_is_named():
    with pytest.raises(ValueError, match="group_size 48 does not divide head_dim 64"):
        QuantSpec(4, "token", 48).check_head_dim(64)


def test_layer_count_mismatch_is_named():
    cfg = KVQuantConfig(layers=(LayerKV(),) * 3, name="three")
    with pytest.raises(ValueError, match="has 3 layer specs but the model has 30 layers"):
        cfg.resolve(30)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ('{"name": "x"}', "kvq_ao_config"),
        ('{"kvq_ao_config": 1, "default": {"key": {"bits": 7}}}', "bits must be one of"),
        ('{"kvq_ao_config": 1, "default": {"key": {"bitz": 4}}}', r"unknown field\(s\) \['bitz'\]"),
        ('{"kvq_ao_config": 99}', "unsupported config version"),
        ('{"kvq_ao_config": 1, "layers": {"0": {}}}', "'layers' must be a list"),
        ('{"kvq_ao_config": 1, "scale_dtype": "int8"}', "scale_dtype must be one of"),
    ],
)
def test_invalid_json_files_are_rejected_with_the_reason(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        KVQuantConfig.load(path)


def test_config_is_frozen():
    with pytest.raises(Exception):
        KVQuantConfig.preset("int8").residual_length = 3


def test_max_outliers_sizes_the_slots_round_trips_and_is_checked():
    spec = QuantSpec(4, "channel", 128, "nuq", 0.01, max_outliers=2)
    assert (spec.outlier_slots(64), QuantSpec(4, "channel", 128, "nuq", 0.01).outlier_slots(64)) == (2, 1)
    assert QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.label() == "nuq4-c128+1%x2" and "max_outliers" not in QuantSpec(4, outliers=0.01).to_dict()
    assert QuantSpec(None, outliers=0.01, max_outliers=2).outlier_slots(64) == 0  # full precision holds no slots
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="max_outliers must be a positive int"):
            QuantSpec(4, outliers=0.01, max_outliers=bad)
    with pytest.raises(ValueError, match="max_outliers needs outliers > 0"):
        QuantSpec(4, max_outliers=2)
    with pytest.raises(ValueError, match="max_outliers 65 exceeds head_dim 64"):
        QuantSpec(4, outliers=0.01, max_outliers=65).check_head_dim(64)


def test_outlier_dtype_round_trips_labels_and_is_checked():
    spec = QuantSpec(3, "token", 32, outliers=0.02, outlier_rule="vector", outlier_dtype="float16")
    assert QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.label() == "int3-t32+2%v/f16" and "outlier_dtype" not in QuantSpec(4, outliers=0.01).to_dict()
    assert spec.outlier_values_dtype(torch.float32) == torch.float16
    assert QuantSpec(3, outliers=0.02).outlier_values_dtype(torch.bfloat16) == torch.bfloat16  # "model"
    with pytest.raises(ValueError, match="outlier_dtype must be one of"):
        QuantSpec(3, outliers=0.02, outlier_dtype="float8")


def test_calibrated_key_ranges_round_trip_label_and_are_checked():
    spec = QuantSpec(3, "channel", 128, "nuq", 0.01, ranges="calibrated", outlier_dtype="float16")
    assert QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.label() == "nuq3-cal+1%/f16" and "ranges" not in QuantSpec(4, "channel").to_dict()
    assert spec.token_block == 1 and QuantSpec(3, "channel", 128).token_block == 128  # coded on arrival
    assert QuantSpec(4, "channel", ranges="calibrated").needs_calibration  # even uniform levels, no outliers
    assert not QuantSpec(None, "channel", ranges="calibrated").needs_calibration  # full precision: nothing to fit
    with pytest.raises(ValueError, match="ranges 'calibrated' needs axis 'channel'"):
        QuantSpec(3, "token", 32, ranges="calibrated")
    with pytest.raises(ValueError, match="ranges must be one of"):
        QuantSpec(3, "channel", ranges="static")


def test_int8_key_scores_round_trip_label_and_are_checked():
    """`scores="int8"` (keys scored against an int8 query) survives JSON, shows in the label, and is
    refused where the codes are not a uniform per-channel grid, on values and with pre-RoPE keys."""
    spec = QuantSpec(4, "channel", 32, scores="int8")
    assert QuantSpec.from_dict(spec.to_dict()) == spec and spec.label() == "int4-c32-q8"
    assert "scores" not in QuantSpec(4, "channel", 32).to_dict()
    cfg = PRESETS["kivi-4-q8"]
    assert cfg.default.key.scores == "int8" and cfg.default.value.scores == "float"
    assert KVQuantConfig.from_dict(cfg.to_dict()) == cfg
    for bad in (dict(bits=4, axis="token"), dict(bits=None), dict(bits=4, axis="channel", dtype="nf"), dict(bits=4, scores="int4")):
        with pytest.raises(ValueError, match="scores"):
            QuantSpec(**{"scores": "int8", **bad})
    with pytest.raises(ValueError, match="int8 key scores need pre_rope_keys false"):
        KVQuantConfig(default=LayerKV(spec, QuantSpec(4, "token", 32)), pre_rope_keys=True)
    with pytest.raises(ValueError, match="for keys"):
        KVQuantConfig(default=LayerKV(spec, spec))


def test_8bit_metadata_round_trips_labels_sets_the_format_and_is_checked():
    """`metadata="8-bit"` survives JSON, shows in the label, gives the ops an 8-bit `meta` at the
    default exponent of its levels, and is refused where groups run along channels or nothing is
    quantized; `kvq tune`'s base takes it on its per-token groups only."""
    from kvq_ao.format import FLOAT_META, default_meta_exponent, meta_exponent
    from kvq_ao.tuning.profile import base_config

    spec = QuantSpec(3, "token", 64, "nuq", rotation="hadamard", metadata="8-bit")
    assert QuantSpec.from_dict(spec.to_dict()) == spec and spec.label().endswith("-m8")
    assert "metadata" not in QuantSpec(3, "token", 64).to_dict() and QuantSpec(3, "token", 64).meta == FLOAT_META
    assert meta_exponent(spec.meta) == default_meta_exponent(3, True) and meta_exponent(QuantSpec(2, "token", 32, metadata="8-bit").meta) == -9
    for bad in (dict(bits=4, axis="channel"), dict(bits=None), dict(bits=4, metadata="4-bit")):
        with pytest.raises(ValueError, match="metadata"):
            QuantSpec(**{"metadata": "8-bit", **bad})
    rot, kivi = base_config(dtype="rot", metadata="8-bit"), base_config(dtype="int", metadata="8-bit")
    assert rot.default.key.metadata == rot.default.value.metadata == "8-bit"
    assert (kivi.default.key.metadata, kivi.default.value.metadata) == ("float", "8-bit")  # per-channel keys keep float ranges


def test_depth_spans_pick_layers_by_their_centre_for_any_layer_count(tmp_path):
    """A span holds the layers whose centre (i + 0.5) / n lies in [start, end): layers 0-7 and 15-22
    of 30, proportionally fewer of 8, none left out or doubled at the edges; the first span wins."""
    from kvq_ao.config import DepthSpan

    wide = LayerKV(QuantSpec(4, "token", 64), QuantSpec(2, "token", 64))
    fp = LayerKV(QuantSpec(None), QuantSpec(None))
    cfg = KVQuantConfig(default=LayerKV(QuantSpec(3, "token", 64), QuantSpec(2, "token", 64)),
                        depth_spans=(DepthSpan(0, 0.26, wide), DepthSpan(0.5, 0.76, wide), DepthSpan(0.5, 1, fp)))
    picked = lambda n: [i for i, layer in enumerate(cfg.resolve(n)) if layer == wide]  # noqa: E731
    assert picked(30) == [*range(0, 8), *range(15, 23)]
    assert [i for i, layer in enumerate(cfg.resolve(30)) if layer == fp] == list(range(23, 30))
    assert picked(8) == [0, 1, 4, 5]  # centres 0.0625, 0.1875 | 0.5625, 0.6875
    assert picked(1) == [0]  # one layer, centre 0.5: in the fp span too, but the wide span comes first
    cfg.save(tmp_path / "s.json")
    assert KVQuantConfig.load(tmp_path / "s.json") == cfg


def test_depth_spans_reject_bad_input():
    from kvq_ao.config import DepthSpan

    kv = LayerKV()
    with pytest.raises(ValueError, match=r"start \(0.5\) must be below its end \(0.5\)"):
        DepthSpan(0.5, 0.5, kv)
    with pytest.raises(ValueError, match=r"end must be a fraction of the model's depth in \[0, 1\], got 1.5"):
        DepthSpan(0, 1.5, kv)
    with pytest.raises(ValueError, match="not both"):
        KVQuantConfig(layers=(kv,), depth_spans=(DepthSpan(0, 1, kv),))
    bad = KVQuantConfig(depth_spans=(DepthSpan(0, 1, kv),)).to_dict()
    bad["depth_spans"][0].pop("end")
    with pytest.raises(ValueError, match=r"depth span needs \['end'\]"):
        KVQuantConfig.from_dict(bad)


def test_a_depth_spans_spec_is_checked_as_a_layer_is_and_named_by_its_span():
    from kvq_ao.config import DepthSpan

    rotated_keys = LayerKV(QuantSpec(4, "token", 64, rotation="hadamard"), QuantSpec(4))
    with pytest.raises(ValueError, match=r"depth span 1: rotated keys need pre_rope_keys false"):
        KVQuantConfig(pre_rope_keys=True, depth_spans=(DepthSpan(0, 0.5, LayerKV()), DepthSpan(0.5, 1, rotated_keys)))


def test_a_config_needs_calibration_only_for_the_specs_its_layers_resolve_to():
    """A per-layer list replaces the default: a config whose listed layers need nothing fitted needs
    no calibration, whatever its (unused) default is (seen: `kvq tune --dtype rot` profiling a K8V8
    layer on a base whose default has calibrated levels)."""
    nuq = LayerKV(QuantSpec(4, "token", 64, "nuq"), QuantSpec(3, "token", 64, "nuq"))
    uniform = LayerKV(QuantSpec(8, "token", 64), QuantSpec(8, "token", 64))
    base = KVQuantConfig(default=nuq)
    assert base.needs_calibration
    assert not base.with_layers([uniform, LayerKV(FP, FP)]).needs_calibration
    assert base.with_layers([uniform, nuq]).needs_calibration
    spans = KVQuantConfig(default=uniform, depth_spans=(DepthSpan(0.0, 0.5, nuq),))
    assert spans.needs_calibration and not dataclasses.replace(spans, depth_spans=()).needs_calibration
