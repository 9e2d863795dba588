"""How a vLLM engine's GetLoads becomes the load and fullness the fleet sheds by."""


def test_a_vllm_engine_counts_as_full_when_it_queues_or_its_kv_cache_is_used_up():
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb

    from gateway.upstreams.vllm_grpc import engine_load

    idle = pb.SchedulerLoad(num_running_reqs=3, token_usage=0.5)
    assert engine_load([idle]) == (3, False)
    queueing = pb.SchedulerLoad(num_running_reqs=8, num_waiting_reqs=1, token_usage=0.5)
    assert engine_load([idle, queueing]) == (11, True)
    kv_full = pb.SchedulerLoad(num_running_reqs=2, token_usage=0.99)
    assert engine_load([kv_full]) == (2, True)
