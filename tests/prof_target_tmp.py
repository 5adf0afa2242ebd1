import time
def run(q):
    out = []
    t = time.monotonic()
    def lap(name):
        nonlocal t
        now = time.monotonic(); out.append((name, round(now - t, 3))); t = now
    from m2nkit.adapters.hf_checkpoint import read_checkpoint
    from m2nkit.adapters.trainer_spec import parse_trainer_spec
    from m2nkit.adapters.vllm import vllm_destination
    from m2nkit.engine.demo import shifted_source
    from m2nkit.engine.session import plan_from_manifest
    from m2nkit.manifest.serialize import manifest_to_json
    lap("imports")
    ck = read_checkpoint("/work/main/examples/tiny-qwen3-moe"); lap("read_checkpoint")
    src = shifted_source(ck, parse_trainer_spec("fsdp:3"), 0, {"round": 0}); lap("source")
    metas = list(src.metadata); man = manifest_to_json(metas, 3); lap("manifest")
    plan, _ = plan_from_manifest(man, vllm_destination(ck.config, "vllm:tp=2")); lap("plan")
    q.put(out)
