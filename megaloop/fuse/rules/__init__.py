"""One module per fused op (or op form): the rules that make it, each registered with
``megaloop.fuse.rule.register_rule``. Every module here is loaded (``load_rules``); none is listed."""
