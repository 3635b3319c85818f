"""The worker's per-device memory report (`Info.device_memory`, one start-log line per device) from the running
two-device stack (`up --tensor-parallel 2`, embedded model, one slot), against independent figures: the cache's
size from Info's own per-token and per-sequence KV bytes (the model's one KV head keeps the whole cache on both
devices), the penalty state from the vocabulary (int32 counts + bool flags, split in two), the weights against
the whole model's."""

from __future__ import annotations

import pytest

from protos import model_worker_pb2, model_worker_pb2_grpc

pytestmark = pytest.mark.slow


def test_info_reports_each_devices_share_and_the_log_has_a_line_per_device(tp_stack):
    with tp_stack.internal_channel("worker") as channel:
        info = model_worker_pb2_grpc.ModelWorkerStub(channel).Info(model_worker_pb2.WorkerInfoRequest(), timeout=30)
    devices = info.device_memory
    assert [(d.device_id, d.device_kind) for d in devices] == [(0, "cpu"), (1, "cpu")]
    cache = info.num_slots * (info.kv_bytes_per_token * info.max_model_len + info.kv_bytes_per_sequence)
    for d in devices:
        assert d.kv_bytes == cache  # replicated: one KV head
        # the sparse history (int32 ids and counts of min(2 * max_model_len, V) tokens a slot), whole on each
        assert d.penalty_bytes == info.num_slots * min(2 * info.max_model_len, info.vocab_size) * 8
        assert 0.4 * info.weight_bytes < d.weight_bytes < 0.6 * info.weight_bytes
        assert d.temp_bytes > 0 and d.capacity_bytes == 0  # XLA's CPU reports no limit
    assert devices[0].weight_bytes == devices[1].weight_bytes
    log = tp_stack.log()
    assert "1 slot (as given): weights " in log, log[-3000:]
    for d in devices:
        assert f"device {d.device_id} (cpu): weights " in log, log[-3000:]
