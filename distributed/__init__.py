"""peerline.distributed"""
