"""numaov.runtime.lm"""
