"""peerline.launch.suites"""
