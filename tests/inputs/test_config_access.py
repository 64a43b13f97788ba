"""Reading a config must not stop the input builder: a computed property that raises means "unset"."""

from __future__ import annotations

import transformers as tf

from normswap.inputs.media import cfg, sub_config


class ConfigWithBrokenProperty(tf.PretrainedConfig):
    """A config whose ``encoder_config`` property validates a sub-config that does not fit (as
    WavTokenizer's does when its sizes disagree)."""

    model_type = "broken-property-test"

    @property
    def encoder_config(self) -> tf.PretrainedConfig:
        raise ValueError("`codebook_dim` (512) must equal `hidden_size` (32)")


def test_a_property_that_raises_reads_as_unset():
    config = ConfigWithBrokenProperty(hidden_size=32)
    assert sub_config(config, "encoder") is config
    assert cfg(config, "encoder_config", "hidden_size") == 32
    assert cfg(config, "encoder_config", default=7) == 7
