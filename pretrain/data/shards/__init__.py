"""Token shards: a corpus tokenized once (``./launch.sh tokenize``) into memory-mapped, fixed-size shards with a
document index and a manifest; training reads them with no tokenizer work.

:mod:`~pretrain.data.shards.format` (files, manifest, checks), :mod:`~pretrain.data.shards.units` (the job's units of
work), :mod:`~pretrain.data.shards.writer` (shards, index, manifest, atomically), :mod:`~pretrain.data.shards.reader`
(memory-mapped documents, the training reader) and :mod:`~pretrain.data.shards.compat` (the run's tokenizer against
the shards'). See docs/data.md.
"""
