"""numaov.models.wan.transformer"""
