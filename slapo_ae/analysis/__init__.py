"""From records to results: aggregate CSVs, Figures 7 and 9, Table 4 and its line counter, the
claims, Slapo beside its engines (gaps), the kick-the-tires summary and the one-GPU check.
Every module reads records and writes files, and none imports torch; ``gaps`` (profiles) and
``kick`` (the smoke case) run cases through the case runner.
"""
