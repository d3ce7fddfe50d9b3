"""KDTR: a binary container for configs, weights, inputs and expected outputs."""

from .errors import KdtrError
from .schema import CONFIGS, PRESETS, ConfigError, DDTreeConfig, ModelConfig, YarnScaling
