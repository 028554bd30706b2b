"""numaov.models"""
