"""Every inter-stage decoder, fed random bytes and random msgpack, returns a message of its
channel's declared types or drops the frame: it never raises, so garbage never kills a stage."""

from __future__ import annotations

import typing

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import messages
from shared.transport import FrameDecoder

CHANNELS = {
    "gateway->tokenizer": messages.GatewayToTokenizer,
    "tokenizer->gateway": messages.TokenizerToGateway,
    "gateway->scheduler": messages.GatewayToScheduler,
    "scheduler->gateway": messages.SchedulerToGateway,
    "scheduler->executor": messages.SchedulerToExecutor,
    "executor->scheduler": messages.ExecutorToScheduler,
    "status": messages.StatusToGateway,
}
TAGS = sorted({cls.__name__ for union in CHANNELS.values() for cls in typing.get_args(union) or (union,)})

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=20),
                     st.binary(max_size=20))
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=20,
)
# Maps that look like messages: a real tag, some real field names, random values.
_field_names = st.sampled_from(["request_id", "params", "prompt", "token_ids", "step_id", "seqs", "stage",
                                "replica", "pid", "state", "sent_at", "instance", "text", "status", "message"])
_message_like = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    st.sampled_from(TAGS), st.dictionaries(_field_names, _values, max_size=6),
)


def _members(union) -> tuple[type, ...]:
    return typing.get_args(union) or (union,)


def _check(union, frame: bytes) -> None:
    decoder = FrameDecoder(union, "test")
    msg = decoder.decode(frame)
    if msg is None:
        assert decoder.dropped == 1
    else:
        assert isinstance(msg, _members(union))


@pytest.mark.parametrize("channel", sorted(CHANNELS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame=st.binary(max_size=256))
def test_random_bytes(channel, frame):
    _check(CHANNELS[channel], frame)


@pytest.mark.parametrize("channel", sorted(CHANNELS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.one_of(_values, _message_like))
def test_random_msgpack(channel, value):
    _check(CHANNELS[channel], msgspec.msgpack.encode(value))


def test_a_message_of_another_channel_is_dropped():
    decoder = FrameDecoder(messages.SchedulerToExecutor, "test")
    beat = messages.Heartbeat("scheduler", "s", 1, "ready", 0.0)
    assert decoder.decode(msgspec.msgpack.encode(beat)) is None and decoder.dropped == 1
    hello = messages.SchedulerHello("abc")
    assert decoder.decode(msgspec.msgpack.encode(hello)) == hello
