"""numaov.runtime.placement"""
