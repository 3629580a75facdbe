"""m2r2's build tools, installed as m2r2_tools beside the runtime package (which never imports them): the training
corpora (corpora, from corpus_sources and problems), the tiny OLMoE the expert cache was first measured on
(tiny_olmoe: olmoe_model, olmoe_train) and MoEfication of a dense llama (moefy, moefy_layers). Each runs as
``python -m m2r2_tools.NAME``."""
