"""The post-hoc diagnosis of a finished run (scripts/diagnose.py): its records loaded into series
(`run_data`, `signals`), turned into findings by rules (`findings`, `layer_rules`, `system_rules`,
`diagnosis`), and written out as plots and a report (`plots`, `report`).
"""
