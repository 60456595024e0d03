"""The backend's one configuration object: Options fill every field of ripples_pg._C.Config
(with what the creator finds at creation), a field added on one side only is caught, and the
object never shows its secrets. No process group needed."""
import pytest

from ripples_pg import Options
from ripples_pg.backend._register import load_extension

# What _backend._create_backend finds at creation rather than reads from Options.
FOUND = dict(timeout_s=5.0, bind_addr="127.0.0.1", name="0", host_key="h@x/1",
             host_of=[0, 0, 1], endpoint="", token="")


def _config(opts=None, **found):
    _C = load_extension()
    return (opts or Options()).resolve(env={})._core_config(_C.Config(), **(found or FOUND))


def test_options_fill_every_config_field():
    cfg = _config(Options(transport="tcp", partial=True, on_failure="skip", compression="bf16",
                          stage_chunk_bytes=4096, small_bytes=1024, inline_small=False,
                          authenticated_frames=True, trace=True))
    assert (cfg.tcp_only, cfg.use_ucx) == (True, False)
    assert cfg.partial_by_default and cfg.on_failure_skip and cfg.trace and cfg.frame_macs
    assert not cfg.inline_small
    assert (cfg.compression, cfg.stage_chunk_bytes, cfg.small_bytes) == ("bf16", 4096, 1024)
    assert (cfg.schedule, cfg.host_of, cfg.timeout_s) == ("static", [0, 0, 1], 5.0)
    ucx = _config(Options(transport="ucx_only"))
    assert (ucx.tcp_only, ucx.use_ucx) == (True, True)


def test_a_field_on_one_side_only_is_caught():
    with pytest.raises(RuntimeError, match=r"unset: \['token'\]"):
        _config(**{k: v for k, v in FOUND.items() if k != "token"})
    with pytest.raises(RuntimeError, match=r"unknown: \['no_such_field'\]"):
        _config(**FOUND, no_such_field=1)
    with pytest.raises(RuntimeError, match=r"set twice: \['schedule'\]"):
        _config(**FOUND, schedule="random")


def test_fields_are_listed_once_and_typed():
    _C = load_extension()
    fields = _C.Config.FIELDS
    assert len(fields) == len(set(fields)) and "job_secret" in fields
    cfg = _C.Config()
    assert cfg.compression == "none" and cfg.inline_small is True and cfg.timeout_s == 1800.0
    with pytest.raises(TypeError):
        cfg.small_bytes = "large"
    with pytest.raises(AttributeError):
        cfg.no_such_field = 1


def test_config_never_shows_its_secrets():
    secret = "s3cr3t-" * 4
    cfg = _config(Options(job_secret=secret))
    assert cfg.job_secret == secret  # readable by the code that needs it...
    assert secret not in repr(cfg) and secret not in str(cfg)  # ...never printed
