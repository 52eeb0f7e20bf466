cpdef int hand_over(object cx, object stream, object ev=*) except -1
