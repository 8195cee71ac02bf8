"""The CLI flags come from the config dataclasses, and the kernel help names the kernels that exist."""
import argparse

from kestrel.config import add_cli_args, from_cli_args
from kestrel.kernels import backend_names


def test_flags_round_trip():
    p = argparse.ArgumentParser()
    add_cli_args(p)
    cfg = from_cli_args(p.parse_args(["--max-num-seqs", "4", "--no-enable-prefix-caching", "--linear-backend",
                                      "torch_dense", "--cuda-graph-sizes", "1", "2", "--async-scheduling", "off"]))
    assert cfg.scheduler.max_num_seqs == 4 and cfg.cache.enable_prefix_caching is False
    assert cfg.kernel.linear_backend == "torch_dense" and cfg.compilation.cuda_graph_sizes == [1, 2]
    assert cfg.scheduler.async_scheduling == "off"


def test_kernel_help_lists_every_kernel():
    p = argparse.ArgumentParser()
    add_cli_args(p)
    help_text = " ".join(p.format_help().split())
    for name in backend_names("linear") + backend_names("moe"):
        if name != "auto":
            assert name in help_text
