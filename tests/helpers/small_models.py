"""Small shapes of the models: fast on two cores, each still its model's own structure."""

from bagpipe.config import ModelConfig

# Small shapes of every CTR model: fast on two cores, still each model's own structure.
SMALL = {
    "dlrm": ModelConfig(name="dlrm", emb_dim=8, arch_mlp_bot="13-16-8", arch_mlp_top="16-1"),
    "wide-deep": ModelConfig(name="wide-deep", emb_dim=8, deep_mlp="32-16"),
    "deepfm": ModelConfig(name="deepfm", emb_dim=8, deep_mlp="32-16"),
    "dcn": ModelConfig(name="dcn", emb_dim=8, deep_mlp="32-16", cross_layers=2),
    "dcn-v2": ModelConfig(name="dcn", emb_dim=8, deep_mlp="32-16", cross_layers=2, cross_kind="matrix", cross_rank=4),
    "fgcnn": ModelConfig(name="fgcnn", emb_dim=8, deep_mlp="32", conv_channels="4-6", conv_kernel=3, recombine=1),
}


CASER = ModelConfig(name="caser", emb_dim=16, vertical_filters=4, horizontal_filters=8)
