"""KDTR: a binary container for configs, weights, inputs and expected outputs.

    import kdtr_format
    kdtr_format.write("f.kdtr", {"weights/norm": w}, metadata={"preset": "tiny"})
    with kdtr_format.open("f.kdtr") as f:
        f["weights/norm"]; f.torch("weights/norm"); f.metadata; f.verify()

Byte layout: `kdtr_format.format` (module docstring) and SPEC.md.
"""

__version__ = "0.1.0"

from .errors import ChecksumError, FormatError, KdtrError, TensorNotFoundError, VersionError, WriterError
from .reader import Reader, TensorInfo, open
from .schema import CONFIGS, PRESETS, ConfigError, DDTreeConfig, ModelConfig, YarnScaling
from .hf_config import HFConfig, hf_config_dict, read_hf_config
from .weights import weight_bytes, weight_shapes
from .writer import Writer, write
