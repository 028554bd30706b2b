"""numaov.runtime.wan"""
