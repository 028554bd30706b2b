"""numaov.runtime"""
