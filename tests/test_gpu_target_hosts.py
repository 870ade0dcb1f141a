"""Beyond one host: ddp, zero3 and hsdp compiled for 4 hosts x 8 H100s and 16 x 8 (compile-only,
``jaxdp.runtime.target``), and where their collectives' replica groups put the traffic: over a host's
NVLink, or across hosts over the network.

A ResNet-18 of one block per stage at width 8 keeps the compiles short; the replica groups do not
depend on the model's size (docs/strategies.md has the table for width 64). Global device ids are
the mesh's devices in row-major order, host by host: device d is on host d // 8.
"""

import pytest

from test_gpu_target import require_plugin, run_job

PER_HOST = 8
JOBS = {"ddp": "ddp", "zero3": "zero3", "hsdp": "hsdp"}  # hsdp's default: shard within a host, replicate across


@pytest.fixture(scope="module", params=[4, 16], ids=["4x8", "16x8"])
def hosts(request, tmp_path_factory, module_user_env):
    require_plugin()
    out = tmp_path_factory.mktemp(f"hosts{request.param}")
    return request.param, run_job(out, module_user_env, "h100", PER_HOST, request.param, 8, "1,1,1,1", JOBS)


def host_sets(collective) -> list:
    return [{d // PER_HOST for d in group} for group in collective["groups"]]


def test_hsdp_shards_within_a_host_and_reduces_across_hosts(hosts):
    count, reports = hosts
    r = reports["hsdp"]
    assert r["mesh"] == {"replica": count, "data": PER_HOST} and (r["devices"], r["hosts"]) == (count * PER_HOST, count)
    moving = [c for c in r["collectives"] if c["kind"] in ("all-gather", "reduce-scatter")]
    assert moving and all(len(h) == 1 for c in moving for h in host_sets(c))  # never leave a host
    assert not any(c["across_hosts"] for c in moving)
    # the gradient chunks all-reduced across the replicas: one group per shard index, one device per host
    across = [c for c in r["collectives"] if c["kind"] == "all-reduce" and c["across_hosts"]]
    assert across
    expected = sorted(sorted(s + PER_HOST * h for h in range(count)) for s in range(PER_HOST))
    for c in across:
        if len(c["groups"]) == PER_HOST:
            assert sorted(sorted(g) for g in c["groups"]) == expected
    assert any(len(c["groups"]) == PER_HOST for c in across)


@pytest.mark.parametrize("name", ["ddp", "zero3"])
def test_flat_strategies_span_every_host(hosts, name):
    """ddp's all-reduce and zero3's gathers and reduce-scatters run over all the devices: every byte
    they move crosses the network somewhere in the ring."""
    count, reports = hosts
    r = reports[name]
    main = "all-reduce" if name == "ddp" else "all-gather"
    groups = [c["groups"] for c in r["collectives"] if c["kind"] == main]
    assert groups and all(g == [list(range(count * PER_HOST))] for g in groups)


def test_bytes_per_device_by_link(hosts):
    """The planning answer: bytes each device sends per step over NVLink and over the network. hsdp
    moves most of its bytes within a host; ddp and zero3 send all of theirs across hosts."""
    count, reports = hosts
    link = {}
    for name, r in reports.items():
        sent = {across: sum(c["runs"] * c["ring_bytes"] for c in r["collectives"] if c["across_hosts"] == across)
                for across in (False, True)}
        link[name] = sent
        print(f"{count}x{PER_HOST} {name}: NVLink {sent[False] / 2**20:.2f} MiB, network {sent[True] / 2**20:.2f} MiB")
    assert link["ddp"][False] == 0 and link["zero3"][False] == 0
    assert link["hsdp"][True] < link["hsdp"][False]
    assert link["hsdp"][True] < link["ddp"][True] / 2
