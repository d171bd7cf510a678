"""Synchronisation as data and verbs: the named hardware barriers with their
budget, the stage ring's position (``PipelineState``) and its role verbs
(``Ring``), used by every kernel and read by the proof."""
